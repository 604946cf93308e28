"""Configuration checks that belong to one method, named by its registry entry (``MethodEntry.check``).

:meth:`experiment.config.RunConfig._consistent` runs the checks every run shares (the model family
fits the method, tier lists have one entry per tier, ...) and then the entry's own ``check``; each
raises ``ValueError`` naming the run-config key and the fix, before round 1.  The checks read
only the validated configuration and the installed models: this module imports no strategy, so
the ClientApp, which validates its run config too, stays apart from the server's code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from experiment.lists import split_list
from experiment.method_settings import CodistGroup, DepthFLGroup
from models import cnn
from models.family import parse_widths
from models.transformer import full_config

if TYPE_CHECKING:
    from experiment.config import RunConfig


def server_distillation(cfg: RunConfig) -> None:
    """Co-distillation's distillation data must fit the model: images get crops, text gets headlines."""
    text_only, image_only = ("headlines",), ("crops",)
    source = cfg.settings_of(CodistGroup).distill_data
    if source in (image_only if not cfg.image_data else text_only):
        kind = "image" if cfg.image_data else "text"
        raise ValueError(
            f"run config 'distill-data': {source!r} does not fit {kind} models; use "
            f"{'crops' if cfg.image_data else 'headlines'!r} (out-of-domain) or 'in-domain'"
        )


def pfedknow(cfg: RunConfig) -> None:
    """The checks of pFedKnow and its ablations: the conv CNN or a transformer, the CPU, one tier, a shallow student."""
    if cfg.image_data and cfg.model != cnn.CONV:
        raise ValueError(
            f"run config 'model': {cfg.method!r} prunes HeteroFL's 'conv' CNN (network slimming) or a "
            f"transformer (magnitude pruning, e.g. 'minilm-l6' or 'tiny'); got {cfg.model!r}"
        )
    if cfg.device != "cpu":
        raise ValueError(
            f"run config 'device': {cfg.method!r} trains, prunes and distills on the CPU only; "
            f"use 'cpu', got {cfg.device!r}"
        )
    if len(cfg.tier_names) != 1:
        raise ValueError(
            f"run config 'tiers': {cfg.method!r} trains one lightweight model; give one tier, got {cfg.tier_names}"
        )
    if not cfg.image_data:
        _pfedknow_student(cfg)


def _pfedknow_student(cfg: RunConfig) -> None:
    """A transformer pFedKnow run: one ``tier-layers`` entry, shallower than the full-depth teacher."""
    depths = split_list(cfg.tier_layers, "tier-layers")
    if len(depths) != 1:
        raise ValueError(
            f"run config 'tier-layers': {cfg.method!r} trains one lightweight student; give one depth, "
            f"got {cfg.tier_layers!r}"
        )
    try:
        full = _encoder_layers(cfg)
    except (OSError, ValueError) as exc:
        raise ValueError(f"run config 'model': cannot read {cfg.model!r}'s configuration ({exc})") from None
    if not int(depths[0]) < full:
        raise ValueError(
            f"run config 'tier-layers': pFedKnow's student must be shallower than the teacher (the full "
            f"{full}-layer {cfg.model!r}); got {depths[0]}"
        )


def depthfl(cfg: RunConfig) -> None:
    """DepthFL's tiers are depths of HeteroFL's CNNs or a transformer: ``tier-layers``, increasing, in range.

    The deepest model has ``len(cnn-widths)`` blocks (conv) or stages (preresnet18), or the
    checkpoint's encoder layers; a hub model whose configuration is not cached yet is checked when
    its catalog is built, at start.
    """
    if cfg.image_data and cfg.model not in (cnn.CONV, cnn.PRERESNET18):
        raise ValueError(
            f"run config 'model': {cfg.method!r} cuts HeteroFL's 'conv' CNN (by block), its 'preresnet18' (by stage) "
            f"or a transformer into depths with an exit after each; got {cfg.model!r}"
        )
    if cfg.settings_of(DepthFLGroup).depthfl_exit_head != "linear" and cfg.model != cnn.CONV:
        raise ValueError(
            f"run config 'depthfl-exit-head': bottleneck exits are the {cnn.CONV!r} net's; {cfg.model!r} has exits "
            "of its own form: set depthfl-exit-head = 'linear'"
        )
    depths = [int(x) for x in split_list(cfg.tier_layers, "tier-layers")]
    if len(depths) != len(cfg.tier_names):
        raise ValueError(f"run config 'tier-layers' has {len(depths)} entries but 'tiers' has {len(cfg.tier_names)}")
    what = ("blocks" if cfg.model == cnn.CONV else "stages") if cfg.image_data else "encoder layers"
    try:
        deepest = len(parse_widths(cfg.cnn_widths)) if cfg.image_data else _encoder_layers(cfg)
    except (OSError, ValueError):  # a hub model not in the cache: its catalog says so at start
        deepest = max(depths)
    if depths[-1] > deepest:  # increasing and positive: the tier-layers validator
        raise ValueError(
            f"run config 'tier-layers': {cfg.method!r} needs depths strictly increasing in 1 .. {deepest} "
            f"(the model's {what}), one per tier; got {depths}"
        )


def _encoder_layers(cfg: RunConfig) -> int:
    """The full-depth encoder layers of the transformer ``model`` names (its configuration; may need the hub)."""
    return full_config(cfg.model, cfg.num_labels).num_hidden_layers

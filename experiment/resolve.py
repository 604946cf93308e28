"""The experiment a run configuration describes, derived once (issue 20, stage 3).

:class:`~experiment.config.RunConfig` is the flat, validated wire schema of the run-config
keys; what the apps need from it -- the model family, the variant catalog and the variants the
method trains, the data and local-training settings, each tier's memory budget and width rate --
is derived here, from the configuration alone, the first time it is asked for and then kept
(``RunConfig.experiment``).  Each part is derived lazily: a run on a hub model that is not in
the local cache builds no catalog until the ServerApp needs one (the launcher's pre-flight stops
before it), and a CNN run never parses ``tier-layers``.

Nothing here reads a message, a node or a file: the same configuration gives the same
experiment in every process (ServerApp, ClientApp, Ray actor, launcher).
"""

from __future__ import annotations

from functools import cached_property
from itertools import pairwise
from typing import TYPE_CHECKING

from experiment import registry
from experiment.config import ConfigError
from experiment.lists import split_list
from experiment.method_settings import PFedKnowGroup
from models import cnn
from models.architectures import architecture_catalog
from models.catalog import VariantCatalog
from models.codist import CodistFamily, codist_catalog
from models.data import DataSpec
from models.family import ArchitectureFamily, CNNFamily, ModelFamily, TransformerFamily, parse_widths
from models.training import TrainSettings
from models.transformer import TransformerSpec, depth_catalog, matched_width_rates, width_catalog

if TYPE_CHECKING:
    from experiment.config import RunConfig


def auto_memory_budgets(estimates_mb: list[float], overhead_mb: float) -> list[float]:
    """``tier-memory-mb = "auto"``: a budget per variant that fits exactly that variant.

    With ``e_i`` the training-memory estimate of the ``i``-th variant (weakest first) and ``o``
    the runtime overhead, tier ``i`` gets ``o + (e_i + e_{i+1}) / 2`` and the strongest
    ``o + 1.25 e_n``: above its own variant's estimate, below the next one's.
    """
    tops = [(a + b) / 2 for a, b in pairwise(estimates_mb)] + [1.25 * estimates_mb[-1]]
    return [overhead_mb + t for t in tops]


def halving_width_rates(tiers: int) -> list[float]:
    """``tier-widths = "auto"`` on a CNN: the rate halves per tier below the strongest (HeteroFL's levels).

    ``[0.5^(n-1), ..., 0.25, 0.5, 1]`` for ``n`` tiers.
    """
    return [0.5 ** (tiers - 1 - i) for i in range(tiers)]


class Experiment:
    """What one run configuration describes; every part derived on first use, then kept.

    Parameters
    ----------
    cfg : RunConfig
        The validated run configuration (its own validators ran: every list parses).

    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    @property
    def entry(self) -> registry.MethodEntry:
        """The method's registry entry."""
        return registry.lookup(self.cfg.method)

    @cached_property
    def transformer_spec(self) -> TransformerSpec:
        """The transformer family's settings (source, labels, frozen word embeddings, pooling)."""
        cfg = self.cfg
        return TransformerSpec(
            source=cfg.model,
            num_labels=cfg.num_labels,
            freeze_word_embeddings=cfg.freeze_word_embeddings,
            pooling=cfg.pooling,
        )

    @cached_property
    def family(self) -> ModelFamily:
        """The model family the apps build variants from: the method's own (its entry's hook), else the model's."""
        return self.method_models or self.model_family

    @cached_property
    def method_models(self) -> registry.MethodModels | None:
        """The method's own models over the model's family (``MethodEntry.family_hook``; DepthFL's exits)."""
        hook = self.entry.family_hook
        return None if hook is None else hook(self.model_family, self.cfg)

    @cached_property
    def model_family(self) -> ModelFamily:
        """The family the ``model`` key names."""
        cfg = self.cfg
        kind = cfg.family_kind
        if kind == "codist":
            return CodistFamily(in_channels=cfg.image_channels, num_classes=cfg.num_labels, image_size=cfg.image_size)
        if kind == "architectures":
            return ArchitectureFamily(width=cfg.arch_width, in_channels=cfg.image_channels, num_classes=cfg.num_labels)
        if kind == "cnn":
            base = parse_widths(cfg.cnn_widths)
            return CNNFamily(name=cfg.model, base=base, in_channels=cfg.image_channels, num_classes=cfg.num_labels)
        return TransformerFamily(self.transformer_spec, max_seq_len=cfg.max_seq_len)

    @property
    def _server_carves(self) -> tuple[int, int]:
        """Training examples the server keeps: pFedKnow's ``D_s`` and its teacher's public set, else none."""
        if self.entry.client != "unlabeled-pruning":
            return 0, 0
        own = self.cfg.settings_of(PFedKnowGroup)
        return own.pfedknow_labeled_size, own.pfedknow_teacher_public_size

    @cached_property
    def data(self) -> DataSpec:
        """The data settings: which set, its columns, the partitioning and the server's held-out split.

        pFedKnow's runs carve the server's labeled set out of the training split before the
        clients' partitions (``pfedknow-labeled-size``, then ``pfedknow-teacher-public-size``); every
        other run carves none.
        """
        cfg = self.cfg
        labeled_size, public_size = self._server_carves
        return DataSpec(
            dataset=cfg.dataset,
            kind="image" if cfg.image_data else "text",
            text_column=cfg.text_column,
            image_column=cfg.image_column,
            label_column=cfg.label_column,
            partitioner=cfg.partitioner,
            dirichlet_alpha=cfg.dirichlet_alpha,
            client_test_fraction=cfg.client_test_fraction,
            client_test_split=cfg.client_test_split,
            server_test_size=cfg.server_test_size,
            eval_split=cfg.eval_split,
            validation_fraction=cfg.validation_fraction,
            server_labeled_size=labeled_size,
            server_public_size=public_size,
            train_size=cfg.train_size,
            seed=cfg.seed,
        )

    @cached_property
    def train(self) -> TrainSettings:
        """Local-training settings (optimizer, learning rate, weight decay, steps or epochs)."""
        cfg = self.cfg
        return TrainSettings(
            optimizer=cfg.optimizer,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            local_steps=cfg.local_steps,
            local_epochs=cfg.local_epochs,
        )

    @cached_property
    def width_rates(self) -> list[float]:
        """Width rate per tier: explicit, or ``"auto"``.

        ``"auto"`` matches the transformer's depth variants' parameter counts
        (:func:`models.transformer.matched_width_rates`), and for a CNN halves the rate per tier
        below the strongest (:func:`halving_width_rates`).
        """
        cfg = self.cfg
        if cfg.tier_widths == "auto" and cfg.is_cnn:
            return halving_width_rates(len(cfg.tier_names))
        if cfg.tier_widths == "auto":
            return matched_width_rates(self.transformer_spec, [d for _, d in cfg.tier_depths])
        return [float(x) for x in split_list(cfg.tier_widths, "tier-widths")]

    @cached_property
    def catalog(self) -> VariantCatalog:
        """Every tier's variant: pools, architectures, width variants (HeteroFL/FedRolex, CNNs) or depth variants.

        Each variant carries its layout and a training-memory estimate at the run's batch size
        (and sequence length) with its optimizer.
        """
        cfg = self.cfg
        batch, optimizer, kind = cfg.batch_size, cfg.optimizer, cfg.family_kind
        if self.method_models is not None:
            return self.method_models.catalog(
                cfg.tier_depths, batch_size=batch, optimizer=optimizer, seq_len=cfg.max_seq_len,
                image_size=cfg.image_size,
            )  # fmt: skip
        if kind == "codist":
            return codist_catalog(
                [(t, t) for t in cfg.tier_names], in_channels=cfg.image_channels, num_classes=cfg.num_labels,
                image_size=cfg.image_size, batch_size=batch, optimizer=optimizer,
            )  # fmt: skip
        if kind == "architectures":
            return architecture_catalog(
                cfg.tier_names, width=cfg.arch_width, in_channels=cfg.image_channels, num_classes=cfg.num_labels,
                image_size=cfg.image_size, batch_size=batch, optimizer=optimizer,
            )  # fmt: skip
        try:
            if kind == "cnn":
                return cnn.width_catalog(
                    cfg.model, list(zip(cfg.tier_names, self.width_rates, strict=True)),
                    in_channels=cfg.image_channels, num_classes=cfg.num_labels, image_size=cfg.image_size,
                    batch_size=batch, base=parse_widths(cfg.cnn_widths), optimizer=optimizer,
                )  # fmt: skip
            if self.entry.width_tiers:
                return width_catalog(
                    self.transformer_spec, list(zip(cfg.tier_names, self.width_rates, strict=True)),
                    batch_size=batch, seq_len=cfg.max_seq_len, optimizer=optimizer,
                )  # fmt: skip
        except ValueError as exc:
            raise ConfigError(f"run config 'tier-widths': {exc}") from None
        return depth_catalog(
            self.transformer_spec, cfg.tier_depths, batch_size=batch, seq_len=cfg.max_seq_len, optimizer=optimizer
        )

    @cached_property
    def training_catalog(self) -> VariantCatalog:
        """The variants the method trains: the largest (AllLarge, ExclusiveFL), the smallest (AllSmall), or all."""
        full = self.catalog
        if self.entry.trains == "largest":
            return VariantCatalog(full.family, (full.largest,))
        if self.entry.trains == "smallest":
            return VariantCatalog(full.family, (full.smallest,))
        return full

    @cached_property
    def memory_budgets(self) -> dict[str, float]:
        """Emulated memory budget (MiB) per tier: ``tier-memory-mb``, or ``"auto"`` (:func:`auto_memory_budgets`)."""
        cfg = self.cfg
        if cfg.tier_memory_mb == "auto":
            estimates = [float(v.memory.total_mb) for v in self.catalog]
            return dict(zip(self.catalog.names(), auto_memory_budgets(estimates, cfg.runtime_overhead_mb), strict=True))
        values = [float(x) for x in split_list(cfg.tier_memory_mb, "tier-memory-mb")]
        return dict(zip(cfg.tier_names, values, strict=True))

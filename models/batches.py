"""Input batches of either model kind: an image tensor, or a text model's keyword inputs.

One home for what the server's distillation (:mod:`strategies.codistill`,
:mod:`strategies.pfedknow`) and pFedKnow's client (:mod:`client.pfedknow`) do with a batch:
count its rows, take some of them, run a model on it.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

#: One batch: an image tensor ``(B, C, H, W)``, or keyword inputs of a text model
#: (``input_ids``, ``attention_mask``, each ``(B, L)``).
Batch = Tensor | Mapping[str, Tensor]


class BatchError(ValueError):
    """A batch is malformed (its keyword inputs disagree on the number of rows)."""


def model_logits(model: nn.Module, x: Batch) -> Tensor:
    """Logits of ``model`` on one batch: ``model(x)`` for a tensor, ``model(**x)`` for keyword inputs.

    A Hugging Face output is unwrapped to its ``.logits``.
    """
    out = model(**x) if isinstance(x, Mapping) else model(x)
    return out if isinstance(out, Tensor) else out.logits


def batch_size_of(x: Batch) -> int:
    """Number of examples in a batch (the first dimension of its tensor(s))."""
    if isinstance(x, Tensor):
        return int(x.shape[0])
    sizes = {int(v.shape[0]) for v in x.values()}
    if len(sizes) != 1:
        raise BatchError(f"keyword inputs disagree on the number of examples: {sorted(sizes)}")
    return sizes.pop()


def take_rows(x: Batch, index: Tensor) -> Batch:
    """Rows ``index`` of a batch: an image tensor, or text keyword inputs.

    Text inputs (``input_ids``, ``attention_mask``, ... each ``(N, L)``) are cut to the longest
    kept row's ``attention_mask``: padding beyond it changes no logit of a BERT-style model.  An
    empty selection keeps the full width.
    """
    if isinstance(x, Tensor):
        return x[index]
    rows = {k: v[index] for k, v in x.items()}
    mask = rows.get("attention_mask")
    if mask is not None and mask.dim() == 2 and mask.shape[0] > 0 and mask.shape[1] > 0:
        width = max(int(mask.sum(dim=1).max()), 1)
        rows = {k: v[:, :width] if v.dim() == 2 and v.shape[1] == mask.shape[1] else v for k, v in rows.items()}
    return rows

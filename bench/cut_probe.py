"""How much of the pretrained encoder's utility each tier's *starting* model keeps (issue 19, C2).

InclusiveFL (Liu et al., KDD 2022, Sec. 5.2) explains HeteroFL's collapse on GLUE by its sub-models'
start: "cropping the network in HeteroFL cannot fully utilize the pre-trained parameters while a
layer-wise sharing in InclusiveFL can better maintain the utility of a pre-trained model" (its
Fig. 3: InclusiveFL's small models start better).  This script measures that utility directly,
before any federated round, on the run's validation split:

* the depth cuts InclusiveFL's tiers start from (the first ``k`` pretrained layers, full width);
* the width cuts HeteroFL's tiers start from (the leading ``r`` share of every hidden, attention
  and feed-forward axis of all layers, ``strategies.heterofl.extract_submodel``, the rates
  matched to the depth cuts' parameter counts as the run matches them, and any ``--rates``
  snapped to whole heads as the run snaps them);
* every cut read after ``0 .. L`` layers (``0`` = the embedding layer's output: the word
  embeddings plus position and type, LayerNorm-ed), so the table also shows how much of the
  signal the embedding layer alone carries.

The utility measure is a linear probe on frozen features: the pooled last state ``h`` (the
attention-masked mean, :func:`models.transformer.masked_mean`, or the first token's state),
standardized with the probe-training set's mean and deviation, and a multinomial logistic
regression ``p(y | h) = softmax(W h + b)`` fitted by L-BFGS on
``mean_i CE(W h_i + b, y_i) + (l2 / 2) ||W||^2`` (:func:`fit_linear_probe`); its accuracy on
the held-out split is reported.  Everything is deterministic: the probe-training snippets are
a seeded sample of the run's training data, the models the pretrained checkpoint.

Usage::

    python -m bench.cut_probe [--seed 7] [--train 3000] [--pooling mean] [--source minilm-l6]

The held-out split is the validation carve (``eval-split = "validation"``): the test split is
never read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from deploy.markdown import markdown_rows
from models.data import DataSpec, load_splits, seeded_sample, text_inputs
from models.transformer import (
    TransformerSpec,
    bert_width_rules,
    build_model,
    classifier_class,
    full_config,
    load_tokenizer,
    masked_mean,
    matched_width_rates,
    snap_rate,
    width_config,
)
from strategies.heterofl import WidthRules, extract_submodel


@dataclass(frozen=True)
class LinearProbe:
    """A fitted probe: standardization ``(h - mean) / std`` then logits ``W z + b``."""

    mean: Tensor
    std: Tensor
    weight: Tensor
    bias: Tensor

    def predict(self, features: Tensor) -> Tensor:
        """Class index ``argmax_c (W z + b)_c`` per row of ``features``."""
        z = (features - self.mean) / self.std
        return (z @ self.weight.T + self.bias).argmax(dim=1)


def fit_linear_probe(
    features: Tensor, labels: Tensor, *, num_classes: int, l2: float = 1e-2, steps: int = 500
) -> LinearProbe:
    """Fit ``softmax(W z + b)`` to ``labels`` by full-batch L-BFGS on standardized ``features``.

    Minimizes ``mean_i CE(W z_i + b, y_i) + (l2 / 2) ||W||_F^2`` with
    ``z = (h - mean) / std`` (``std`` floored at 1e-6), starting from ``W = 0, b = 0``; the
    objective is strictly convex for ``l2 > 0``, so the result does not depend on the start.

    Parameters
    ----------
    features : Tensor
        ``(N, H)`` frozen features.
    labels : Tensor
        ``(N,)`` class indices in ``[0, num_classes)``.
    num_classes : int
        Number of classes.
    l2 : float
        Ridge penalty on ``W`` (not on ``b``).
    steps : int
        L-BFGS iterations at most (it stops earlier once the gradient is below 1e-10).

    """
    x = features.to(torch.float64)
    mean = x.mean(dim=0)
    std = x.std(dim=0).clamp(min=1e-6)
    z = (x - mean) / std
    weight = torch.zeros(num_classes, x.shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(num_classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS(
        [weight, bias], max_iter=steps, tolerance_grad=1e-10, tolerance_change=1e-14, line_search_fn="strong_wolfe"
    )

    def objective() -> Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(z @ weight.T + bias, labels) + 0.5 * l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(objective)
    return LinearProbe(mean=mean, std=std, weight=weight.detach(), bias=bias.detach())


def pool(hidden: Tensor, attention_mask: Tensor, pooling: str) -> Tensor:
    """``masked_mean(hidden)`` for ``"mean"``, the first token's state for ``"cls"``."""
    if pooling == "mean":
        return masked_mean(hidden, attention_mask)
    if pooling == "cls":
        return hidden[:, 0]
    raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")


@torch.no_grad()
def layer_features(
    model: PreTrainedModel, inputs: dict[str, Tensor], *, pooling: str, batch_size: int = 128
) -> list[Tensor]:
    """Pooled states after ``0 .. L`` encoder layers, one ``(N, H)`` tensor per depth.

    The state after ``k`` layers of the full model is exactly the last state of its ``k``-layer
    depth cut (the cut keeps the first ``k`` pretrained layers), so one pass serves every cut.
    """
    model.eval()
    per_depth: list[list[Tensor]] = []
    n = inputs["input_ids"].shape[0]
    for start in range(0, n, batch_size):
        ids = inputs["input_ids"][start : start + batch_size]
        mask = inputs["attention_mask"][start : start + batch_size]
        states = model.base_model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        if not per_depth:
            per_depth = [[] for _ in states]
        for k, h in enumerate(states):
            per_depth[k].append(pool(h, mask, pooling))
    return [torch.cat(parts) for parts in per_depth]


def width_cut_model(spec: TransformerSpec, full: PreTrainedModel, rate: float) -> PreTrainedModel:
    """The full-depth model at width ``rate`` whose weights are HeteroFL's leading slices of ``full``'s."""
    params = {k: v.detach() for k, v in full.named_parameters()}
    names = list(params)
    sub = extract_submodel(params, WidthRules(axes=bert_width_rules(names)), rate)
    model = classifier_class(spec)(width_config(spec, rate))
    missing, unexpected = model.load_state_dict(sub, strict=False)
    if unexpected or any(k in names for k in missing):
        raise ValueError(f"width cut does not fit its configuration: missing {missing}, unexpected {unexpected}")
    return model


@dataclass(frozen=True)
class ProbeTable:
    """Probe accuracies per width cut (``rows``), one per number of layers read (``0 .. L``)."""

    source: str
    pooling: str
    train: int
    held_out: int
    majority: float
    matched_rates: dict[str, float]
    rows: dict[str, list[float]]

    def markdown(self) -> str:
        """The table as markdown, one row per cut, one column per layers read."""
        layers = len(next(iter(self.rows.values())))
        return markdown_rows(
            ["cut", *(f"{k} layers" for k in range(layers))],
            ([label, *(f"{a:.3f}" for a in accs)] for label, accs in self.rows.items()),
        )


def probe_table(
    spec: TransformerSpec,
    data: DataSpec,
    *,
    train_size: int,
    depths: Sequence[int],
    rates: Sequence[float] = (),
    max_length: int = 48,
) -> ProbeTable:
    """Validation accuracy of a linear probe per (width cut, layers read); see the module docstring."""
    train, held_out = load_splits(data)
    train = seeded_sample(train, train_size, data.seed)
    tokenizer = load_tokenizer(spec.source)
    x_train = text_inputs(list(train["text"]), tokenizer, max_length=max_length)
    x_held = text_inputs(list(held_out["text"]), tokenizer, max_length=max_length)
    y_train = torch.tensor(train["label"])
    y_held = torch.tensor(held_out["label"])
    layers = full_config(spec.source, spec.num_labels).num_hidden_layers
    torch.manual_seed(data.seed)
    full = build_model(spec, layers, pretrained=True)
    matched = matched_width_rates(spec, depths)
    rows: dict[str, list[float]] = {}
    cuts = [("width 1 (depth cuts)", 1.0), *[(f"width {r:.3f}", r) for r in sorted({*matched, *rates}, reverse=True)]]
    for label, rate in cuts:
        model = full if rate == 1.0 else width_cut_model(spec, full, rate)
        f_train = layer_features(model, x_train, pooling=spec.pooling)
        f_held = layer_features(model, x_held, pooling=spec.pooling)
        accs = []
        for k in range(len(f_train)):
            probe = fit_linear_probe(f_train[k], y_train, num_classes=spec.num_labels)
            accs.append(float((probe.predict(f_held[k].to(torch.float64)) == y_held).double().mean()))
        rows[label] = accs
    majority = float(max((y_held == c).double().mean() for c in range(spec.num_labels)))
    return ProbeTable(
        source=spec.source,
        pooling=spec.pooling,
        train=len(train),
        held_out=len(held_out),
        majority=majority,
        matched_rates={str(d): r for d, r in zip(depths, matched, strict=True)},
        rows=rows,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Print the probe table (and its JSON with ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="minilm-l6")
    ap.add_argument("--seed", type=int, default=7, help="probe-training sample seed (7: a seed no table reports)")
    ap.add_argument(
        "--train", type=int, default=3000, help="probe-training snippets drawn from the run's training data"
    )
    ap.add_argument("--pooling", default="mean", choices=("mean", "cls"))
    ap.add_argument(
        "--depths", default="2:4", help="InclusiveFL's smaller depth cuts; HeteroFL's rates match their sizes"
    )
    ap.add_argument("--rates", default="", help="more width rates to probe, e.g. 0.5833333333:0.8333333333")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = TransformerSpec(source=args.source, num_labels=2, pooling=args.pooling)
    data = DataSpec(eval_split="validation", seed=args.seed)
    depths = [int(d) for d in args.depths.split(":")]
    rates = [snap_rate(spec, float(r))[0] for r in args.rates.split(":") if r]
    table = probe_table(spec, data, train_size=args.train, depths=depths, rates=rates)
    if args.json:
        print(json.dumps(dataclasses.asdict(table), indent=1))
        return 0
    print(
        f"linear probe on frozen {table.pooling}-pooled states, {table.train} training snippets -> "
        f"{table.held_out} validation snippets (majority {table.majority:.3f}); "
        f"width rates matched to depths {args.depths}: {table.matched_rates}"
    )
    print(table.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())

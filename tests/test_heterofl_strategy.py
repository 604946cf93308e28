"""HeteroFL / FedRolex strategy glue on the tiny transformer: extraction, validation, coverage."""

from __future__ import annotations

import torch
from transformers import BertConfig

from experiment.config import RunConfig
from experiment.method_settings import ServerAdamGroup
from models.transformer import (
    TransformerSpec,
    bert_width_rules,
    config_layout,
    depth_layout,
    initial_states,
    matched_width_rates,
    width_config,
)
from server.app import build_strategy
from strategies.fedadam import FedAdamConfig
from strategies.heterofl import HeteroFL
from tests.toy import reply, sent, trained

Q = "bert.encoder.layer.0.attention.self.query.weight"


def make(method: str = "heterofl") -> tuple[RunConfig, HeteroFL]:
    cfg = RunConfig(model="tiny", method=method, tier_widths="0.25:0.5:1")  # type: ignore[arg-type]
    strategy = build_strategy(cfg)
    assert isinstance(strategy, HeteroFL)
    full = initial_states(cfg.transformer_spec(), cfg.catalog, seed=0)["strong"]
    strategy.set_state({HeteroFL.GLOBAL: full})
    return cfg, strategy


def test_width_variants_scale_heads_hidden_and_intermediate_together() -> None:
    cfg, s = make()
    spec = cfg.transformer_spec()
    weak = width_config(spec, 0.25)
    assert (weak.num_attention_heads, weak.hidden_size, weak.intermediate_size) == (1, 8, 16)
    payload = s.variant_payload(1, "weak")
    layout = cfg.catalog.get("weak").layout.by_name()
    assert {k: tuple(v.shape) for k, v in payload.items()} == {k: p.shape for k, p in layout.items()}
    assert payload["classifier.weight"].shape == (2, 8)  # classes never reduced
    assert payload["bert.embeddings.word_embeddings.weight"].shape[0] == 30522  # vocabulary never reduced
    assert torch.equal(payload[Q], s.state["global"][Q][:8, :8])  # leading slice
    assert set(bert_width_rules(list(layout))) == set(layout)


def test_coverage_aggregation_per_element() -> None:
    _, s = make()
    before = {k: v.clone() for k, v in s.state["global"].items()}
    replies = []
    for node, variant, shift, n in ((1, "weak", 1.0, 10), (2, "medium", 2.0, 30), (3, "strong", 4.0, 20)):
        payload = s.variant_payload(node, variant)
        trainable = {k: v for k, v in payload.items() if k != "bert.embeddings.word_embeddings.weight"}
        replies.append(reply(sent(s, node, variant), trained(trainable, shift), num_examples=n))
    s.aggregate_train(1, replies)
    report = s.report(1)
    assert report.rejected == [] and report.groups["weak"]["clients"] == 1
    new = s.state["global"][Q]
    old = before[Q]
    # covered by all three (rows/cols < 8): (10*1 + 30*2 + 20*4) / 60 = 2.5
    torch.testing.assert_close(new[:8, :8], old[:8, :8] + 2.5)
    # covered by medium and strong (8 <= i < 16): (30*2 + 20*4) / 50 = 2.8
    torch.testing.assert_close(new[8:16, 8:16], old[8:16, 8:16] + 2.8)
    # only the full model covers the rest
    torch.testing.assert_close(new[16:, 16:], old[16:, 16:] + 4.0)
    # frozen word embeddings are never uploaded: unchanged, bit for bit
    emb = "bert.embeddings.word_embeddings.weight"
    assert torch.equal(s.state["global"][emb], before[emb])


def test_reply_with_full_shapes_for_a_reduced_variant_is_rejected() -> None:
    _, s = make()
    before = {k: v.clone() for k, v in s.state["global"].items()}
    full = {k: v for k, v in s.variant_payload(1, "strong").items() if k != "bert.embeddings.word_embeddings.weight"}
    s.aggregate_train(1, [reply(sent(s, 1, "weak"), trained(full, 1.0))])
    assert len(s.report(1).rejected) == 1
    for k, v in before.items():
        assert torch.equal(s.state["global"][k], v)


def test_fedrolex_window_rolls_one_index_per_round() -> None:
    _, s = make("fedrolex")
    s.current_round = 1
    r1 = s.variant_payload(1, "weak")[Q]
    s.current_round = 2
    r2 = s.variant_payload(1, "weak")[Q]
    g = s.state["global"][Q]
    assert torch.equal(r1, g[:8, :8])
    assert torch.equal(r2, g[1:9, 1:9])


def test_fedadam_server_optimizer_applies_the_coverage_delta() -> None:
    cfg = RunConfig(model="tiny", method="heterofl", tier_widths="0.25:0.5:1", heterofl_server_optimizer="fedadam")
    s = build_strategy(cfg)
    assert isinstance(s, HeteroFL)
    full = initial_states(cfg.transformer_spec(), cfg.catalog, seed=0)["strong"]
    s.set_state({HeteroFL.GLOBAL: full})
    before = {k: v.clone() for k, v in full.items()}
    payload = {k: v for k, v in s.variant_payload(3, "strong").items() if k != "bert.embeddings.word_embeddings.weight"}
    s.aggregate_train(1, [reply(sent(s, 3, "strong"), trained(payload, 0.5))])
    # first FedAdam step on a constant delta d: eta_t * (0.1 d) / (0.1 |d| + tau) ~ eta_t
    a = FedAdamConfig.from_settings(cfg.settings_of(ServerAdamGroup))
    eta_t = a.eta * (1 - a.beta_2**2) ** 0.5 / (1 - a.beta_1**2)
    step = s.state["global"][Q] - before[Q]
    torch.testing.assert_close(step, torch.full_like(step, eta_t * 0.05 / (0.05 + a.tau)))
    assert s.adam.step == 1


def test_fedavg_on_the_smallest_cnn_only_touches_its_slice() -> None:
    """``all-small`` on a CNN: HeteroFL over a one-variant catalog = FedAvg of the rate-1/4 model."""
    cfg = RunConfig.from_flower({"model": "conv", "method": "all-small", "num-labels": 10, "cnn-widths": "8:16:32:64"})
    s = build_strategy(cfg)
    assert isinstance(s, HeteroFL) and s.catalog.names() == ["weak"] and s.full.name == "strong"
    full = cfg.family().initial_states(cfg.catalog, seed=0)["strong"]
    s.set_state({HeteroFL.GLOBAL: full})
    before = {k: v.clone() for k, v in full.items()}
    payload = s.variant_payload(1, "weak")
    assert payload["blocks.0.conv.weight"].shape == (2, 1, 3, 3)
    replies = [
        reply(sent(s, n, "weak"), trained(payload, shift), num_examples=w)
        for n, shift, w in ((1, 1.0, 10), (2, 3.0, 30))
    ]
    s.aggregate_train(1, replies)
    w = s.state["global"]["blocks.1.conv.weight"]
    old = before["blocks.1.conv.weight"]
    torch.testing.assert_close(w[:4, :2], old[:4, :2] + 2.5)  # (10 * 1 + 30 * 3) / 40
    assert torch.equal(w[4:], old[4:]) and torch.equal(w[:, 2:], old[:, 2:])  # outside the slice: untouched
    assert s.models_for_evaluation().keys() == {"weak"}


def bert_classifier_params(cfg: BertConfig) -> int:
    """``(V + P + T + 2) h + L (4 h^2 + 2 h i + 9 h + i) + h^2 + h + C h + C`` for hidden ``h``, intermediate ``i``."""
    d = cfg.to_dict()
    h, i, n_layers, classes = d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"], cfg.num_labels
    embeddings = (d["vocab_size"] + d["max_position_embeddings"] + d["type_vocab_size"] + 2) * h
    per_layer = 4 * h * h + 2 * h * i + 9 * h + i  # Q, K, V, attention output, 2 LayerNorms, feed-forward in/out
    return int(embeddings + n_layers * per_layer + h * h + h + classes * h + classes)


def test_minilm_width_variants_match_the_formula_and_the_depth_variants() -> None:
    spec = TransformerSpec()  # the embedded MiniLM-L6: 12 heads of 32, intermediate 1536
    for rate in (1 / 12, 0.25, 0.5, 0.75, 1.0):
        cfg = width_config(spec, rate)
        k = round(rate * 12)
        assert (cfg.num_attention_heads, cfg.hidden_size, cfg.intermediate_size) == (k, 32 * k, 128 * k)
        assert config_layout(spec, cfg).num_params() == bert_classifier_params(cfg)
    rates = matched_width_rates(spec, [2, 4, 6])
    assert rates == [9 / 12, 11 / 12, 1.0]
    for depth, rate in zip((2, 4, 6), rates, strict=True):
        width_count = config_layout(spec, width_config(spec, rate)).num_params()
        depth_count = depth_layout(spec, depth).num_params()
        assert abs(width_count - depth_count) <= 0.05 * depth_count, (depth, width_count, depth_count)


def test_the_initial_state_is_one_full_model_for_heterofl_and_one_per_variant_otherwise() -> None:
    """The hook the ServerApp and the benchmarks share (no isinstance special case in either)."""
    cnn = {"model": "conv", "num-labels": 10, "cnn-widths": "8:16:32:64"}
    for method in ("heterofl", "all-small"):  # all-small on a CNN: HeteroFL over the smallest width
        cfg = RunConfig.from_flower({**cnn, "method": method})
        init = cfg.family().initial_states(cfg.catalog, seed=0)
        state = build_strategy(cfg).initial_state(init)
        full = init[cfg.catalog.largest.name]
        assert list(state) == [HeteroFL.GLOBAL] and all(state[HeteroFL.GLOBAL][k] is full[k] for k in full)
    tiny = RunConfig.from_flower({"model": "tiny", "method": "inclusivefl"})
    init = tiny.family().initial_states(tiny.catalog, seed=0)
    assert list(build_strategy(tiny).initial_state(init)) == tiny.catalog.names()
    small = RunConfig.from_flower({"model": "tiny", "method": "all-small"})
    init = small.family().initial_states(small.catalog, seed=0)
    assert list(build_strategy(small).initial_state(init)) == [small.catalog.smallest.name]

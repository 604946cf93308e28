"""pFedKnow's pure math on tiny tensors: uncertainty, schedule, pruning, helper weights, loss, codec."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models.cnn import ConvNet
from models.pruning import (
    channel_masks_to_tensor_masks,
    channel_ratio,
    convnet_channel_groups,
    evidential_uncertainty,
    magnitude_masks,
    progressive_ratio,
    select_pseudo_labels,
    slimming_channel_masks,
    softmax_uncertainty,
)
from models.sparse import (
    SparsePayloadError,
    choose_encoding,
    decode_payload,
    encode_payload,
    encode_tensor,
    index_dtype,
    mask_code_bytes,
    pack_parts,
    to_wire,
    unpack_parts,
)
from strategies.distillation import collaborative_loss
from strategies.pfedknow import helper_weights, personalization_split, weighted_average

# --- uncertainty --------------------------------------------------------------------------------


def test_evidential_uncertainty_exact() -> None:
    z = torch.tensor([[2.0, -1.0, 0.0], [-3.0, -1.0, -0.5], [4.0, 4.0, 1.0]])
    # C / sum(relu(z) + 1): 3 / (3 + 2), 3 / 3, 3 / (3 + 9)
    assert torch.allclose(evidential_uncertainty(z), torch.tensor([0.6, 1.0, 0.25]))


def test_softmax_uncertainty_exact() -> None:
    z = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    assert torch.allclose(softmax_uncertainty(z), torch.tensor([0.5, 0.25]))


def test_select_pseudo_labels_threshold_inclusive() -> None:
    z = torch.tensor([[2.0, -1.0, 0.0], [-3.0, -1.0, -0.5], [4.0, 4.5, 1.0]])
    keep, labels = select_pseudo_labels(z, 0.6, "evidential")
    assert keep.tolist() == [True, False, True]
    assert labels.tolist() == [0, 2, 1]
    with pytest.raises(ValueError):
        select_pseudo_labels(z, 0.5, "entropy")


# --- schedule and pruning -----------------------------------------------------------------------


def test_progressive_ratio_ramps_to_target() -> None:
    assert [progressive_ratio(t, 0.6, 3) for t in (1, 2, 3, 4, 9)] == pytest.approx([0.2, 0.4, 0.6, 0.6, 0.6])
    with pytest.raises(ValueError):
        progressive_ratio(0, 0.5, 3)
    with pytest.raises(ValueError):
        progressive_ratio(1, 1.0, 3)


def _convnet() -> ConvNet:
    torch.manual_seed(0)
    return ConvNet(1.0, in_channels=1, num_classes=3, base=(4, 6, 8))


def test_convnet_channel_groups_cover_producer_and_consumer() -> None:
    groups = convnet_channel_groups(_convnet().state_dict())
    assert [g.scale for g in groups] == ["blocks.0.norm.weight", "blocks.1.norm.weight", "blocks.2.norm.weight"]
    assert ("blocks.1.conv.weight", 1) in groups[0].members
    assert ("classifier.weight", 1) in groups[2].members
    with pytest.raises(ValueError):
        convnet_channel_groups(["encoder.weight"])


def test_slimming_removes_smallest_scales_globally_and_keeps_ratio() -> None:
    model = _convnet()
    groups = convnet_channel_groups(model.state_dict())
    scales = {
        "blocks.0.norm.weight": torch.tensor([0.9, 0.01, 0.5, 0.02]),
        "blocks.1.norm.weight": torch.tensor([0.03, 0.8, 0.7, 0.6, 0.04, 0.5]),
        "blocks.2.norm.weight": torch.tensor([0.3, 0.2, 0.05, 0.9, 0.8, 0.7, 0.6, 0.1]),
    }
    masks = slimming_channel_masks(scales, groups, 0.25)  # 18 channels -> round(4.5) = 4 removed
    assert channel_ratio(masks) == pytest.approx(4 / 18)
    assert masks["blocks.0.norm.weight"].tolist() == [True, False, True, False]
    assert masks["blocks.1.norm.weight"].tolist() == [False, True, True, True, False, True]
    # progressive: a larger ratio removes more, never revives
    more = slimming_channel_masks(scales, groups, 0.5, masks)
    assert channel_ratio(more) == pytest.approx(9 / 18)
    for k in masks:
        assert not bool((more[k] & ~masks[k]).any())
    # a smaller ratio than already removed changes nothing
    same = slimming_channel_masks(scales, groups, 0.1, more)
    assert all(torch.equal(same[k], more[k]) for k in more)


def test_slimming_keeps_one_channel_per_layer() -> None:
    groups = convnet_channel_groups(_convnet().state_dict())
    scales = {
        "blocks.0.norm.weight": torch.zeros(4),
        "blocks.1.norm.weight": torch.ones(6),
        "blocks.2.norm.weight": torch.ones(8),
    }
    masks = slimming_channel_masks(scales, groups, 0.3)  # round(5.4) = 5: 3 from block 0, 2 from block 1
    assert int(masks["blocks.0.norm.weight"].sum()) == 1
    assert channel_ratio(masks) == pytest.approx(5 / 18)


def test_channel_masks_zero_the_channel_everywhere_and_output_is_unchanged() -> None:
    model = _convnet()
    state = model.state_dict()
    groups = convnet_channel_groups(state)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    ch = {g.scale: torch.ones(int(state[g.scale].numel()), dtype=torch.bool) for g in groups}
    ch["blocks.1.norm.weight"][2] = False
    masks = channel_masks_to_tensor_masks(ch, groups, shapes)
    assert not bool(masks["blocks.1.conv.weight"][2].any())
    assert not bool(masks["blocks.1.conv.bias"][2])
    assert not bool(masks["blocks.2.conv.weight"][:, 2].any())
    assert bool(masks["blocks.2.conv.weight"][:, 1].all())
    kept = sum(int(m.sum()) for m in masks.values())
    removed = 9 * 4 + 1 + 1 + 1 + 8 * 9  # conv1 row, bias, bn w, bn b, conv2 input slice
    assert kept == sum(int(m.numel()) for m in masks.values()) - removed
    # zeroing the channel's BN scale and shift alone already kills it (static BN): same logits
    x = torch.randn(4, 1, 12, 12)
    gated = _convnet()
    with torch.no_grad():
        norm = gated.conv_blocks()[1].norm
        norm.weight[2] = 0.0
        norm.bias[2] = 0.0
        pruned = _convnet()
        for name, p in pruned.named_parameters():
            p.mul_(masks[name].to(p.dtype))
        assert torch.allclose(gated.eval()(x), pruned.eval()(x), atol=1e-5)


def test_magnitude_masks_keep_ratio_per_matrix() -> None:
    params = {"w": torch.tensor([[0.5, -0.1, 0.3], [-0.05, 0.9, 0.2]]), "b": torch.tensor([0.001, 2.0])}
    masks = magnitude_masks(params, 0.5)
    assert masks["w"].tolist() == [[True, False, True], [False, True, False]]
    assert bool(masks["b"].all())  # 1-D tensors are not pruned
    more = magnitude_masks(params, 0.7, masks)  # round(4.2) = 4 removed
    assert int((~more["w"]).sum()) == 4 and not bool((more["w"] & ~masks["w"]).any())


# --- helper weights and loss --------------------------------------------------------------------


def test_helper_weights_are_normalized_mask_cosines_without_the_leader() -> None:
    masks = {
        "a": {"w": torch.tensor([1, 1, 0, 0], dtype=torch.bool)},
        "b": {"w": torch.tensor([1, 1, 0, 0], dtype=torch.bool)},
        "c": {"w": torch.tensor([1, 0, 1, 0], dtype=torch.bool)},
        "d": {"w": torch.tensor([0, 0, 1, 1], dtype=torch.bool)},
    }
    w = helper_weights(masks, "a")
    # cos(a, b) = 1, cos(a, c) = 1/2, cos(a, d) = 0 -> normalized by 1.5
    assert set(w) == {"b", "c", "d"}
    assert w["b"] == pytest.approx(2 / 3) and w["c"] == pytest.approx(1 / 3) and w["d"] == 0.0
    assert sum(w.values()) == pytest.approx(1.0)
    assert helper_weights({"a": masks["a"]}, "a") == {}
    assert helper_weights({"a": masks["a"], "d": masks["d"]}, "a") == {"d": 1.0}  # disjoint: uniform


def test_collaborative_loss_terms_on_tiny_logits() -> None:
    z_k = torch.tensor([[1.0, 0.0], [0.0, 2.0]], requires_grad=True)
    y = torch.tensor([0, 1])
    z1, z2 = torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    zp = torch.tensor([[3.0, 0.0], [0.0, 3.0]])
    loss, terms = collaborative_loss(z_k, y, [z1, z2], [0.75, 0.25], zp, temperature=1.0)
    avg = 0.75 * z1 + 0.25 * z2

    def kl(target_logits: torch.Tensor) -> float:
        p = torch.softmax(target_logits, 1)
        return float((p * (p.log() - torch.log_softmax(z_k.detach(), 1))).sum(1).mean())

    assert terms["ce"] == pytest.approx(float(F.cross_entropy(z_k.detach(), y)))
    assert terms["kl-helpers"] == pytest.approx(kl(avg), rel=1e-5)
    assert terms["kl-teacher"] == pytest.approx(kl(zp), rel=1e-5)
    assert float(loss.detach()) == pytest.approx(terms["ce"] + terms["kl-helpers"] + terms["kl-teacher"], rel=1e-6)
    loss.backward()
    assert z_k.grad is not None and bool(torch.isfinite(z_k.grad).all())
    only_ce, t2 = collaborative_loss(z_k, y, [], [], None)
    assert t2["kl-helpers"] == 0.0 and t2["kl-teacher"] == 0.0 and float(only_ce.detach()) == pytest.approx(terms["ce"])
    # the leader's own prediction as the only target: KL = 0
    _, t3 = collaborative_loss(z_k, y, [z_k.detach()], [1.0], z_k.detach())
    assert t3["kl-helpers"] == pytest.approx(0.0, abs=1e-7) and t3["kl-teacher"] == pytest.approx(0.0, abs=1e-7)


def test_weighted_average_fills_pruned_weights_with_zero() -> None:
    a = {"w": torch.tensor([1.0, 0.0])}
    b = {"w": torch.tensor([3.0, 4.0])}
    assert torch.allclose(weighted_average([a, b], [1.0, 3.0])["w"], torch.tensor([2.5, 3.0]))


# --- sparse codec -------------------------------------------------------------------------------


def test_index_dtype_and_code_sizes() -> None:
    assert index_dtype(256) == np.uint8 and index_dtype(257) == np.uint16 and index_dtype(70_000) == np.uint32
    assert mask_code_bytes(1000, 10) == {"bitmask": 125, "index": 20}
    assert choose_encoding(1000, 10) == "index"
    assert choose_encoding(1000, 700) == "bitmask"
    assert choose_encoding(16, 2) == "bitmask"  # 2 bytes each: tie goes to the bitmask
    assert choose_encoding(16, 16) == "dense"


@pytest.mark.parametrize("keep", [0.0, 0.01, 0.3, 0.97, 1.0])
def test_codec_round_trip_is_exact_and_smaller(keep: float) -> None:
    gen = torch.Generator().manual_seed(3)
    params = {"a": torch.randn(33, 7, generator=gen), "b": torch.randn(5, generator=gen), "c": torch.randn(300)}
    masks = {k: torch.rand(v.shape, generator=gen) < keep for k, v in params.items()}
    payload = encode_payload(params, masks)
    got, got_masks = decode_payload(payload, {k: tuple(v.shape) for k, v in params.items()})
    for k, v in params.items():
        assert torch.equal(got_masks[k], masks[k])
        assert torch.equal(got[k], v * masks[k])  # bit-exact
        enc = encode_tensor(v, masks[k])
        n, kept = v.numel(), int(masks[k].sum())
        expected = 4 * n if kept == n else 4 * kept + min(mask_code_bytes(n, kept).values())
        assert enc.nbytes == expected
        if kept < n:
            assert enc.nbytes < 4 * n + math.ceil(n / 8)


def _payload() -> tuple[dict[str, np.ndarray], dict[str, tuple[int, ...]]]:
    params = {"w": torch.arange(1.0, 41.0).reshape(8, 5), "v": torch.arange(1.0, 301.0)}
    masks = {"w": torch.arange(40).reshape(8, 5) % 3 == 0, "v": torch.arange(300) % 50 == 0}
    payload = encode_payload(params, masks)
    assert "w@bitmask" in payload and "v@index" in payload
    return payload, {"w": (8, 5), "v": (300,)}


MALFORMED = {
    "value count mismatch (bitmask)": lambda p: p.update({"w@values": p["w@values"][:-1]}),
    "value count mismatch (index)": lambda p: p.update({"v@values": np.append(p["v@values"], np.float32(1))}),
    "index out of range": lambda p: p.update({"v@index": np.append(p["v@index"][:-1], np.uint16(300))}),
    "index repeated": lambda p: p.update({"v@index": np.sort(np.append(p["v@index"][:-1], p["v@index"][0]))}),
    "index unsorted": lambda p: p.update({"v@index": p["v@index"][::-1].copy()}),
    "bitmask too short": lambda p: p.update({"w@bitmask": p["w@bitmask"][:-1]}),
    "padding bits set": lambda p: p.update({"w@bitmask": p["w@bitmask"] | np.uint8(1)}),
    "NaN value": lambda p: p.update({"w@values": np.full_like(p["w@values"], np.nan)}),
    "Inf value": lambda p: p.update({"v@values": np.full_like(p["v@values"], np.inf)}),
    "wrong dtype": lambda p: p.update({"w@values": p["w@values"].astype(np.float64)}),
    "2-D values": lambda p: p.update({"w@values": p["w@values"].reshape(1, -1)}),
    "missing tensor": lambda p: [p.pop(k) for k in ("w@values", "w@bitmask")],
    "unknown tensor": lambda p: p.update({"x@dense": np.zeros(3, np.float32)}),
    "bad part": lambda p: p.update({"w@rle": np.zeros(3, np.uint8)}),
    "two codes": lambda p: p.update({"w@index": np.zeros(1, np.uint8)}),
    "dense of wrong size": lambda p: [
        p.pop("w@bitmask"),
        p.pop("w@values"),
        p.update({"w@dense": np.zeros(39, np.float32)}),
    ],
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_payloads_are_rejected(case: str) -> None:
    payload, shapes = _payload()
    MALFORMED[case](payload)
    with pytest.raises(SparsePayloadError):
        decode_payload(payload, shapes)


def test_random_corruption_never_passes_silently() -> None:
    """Fuzz: random byte flips in codes/values either decode to a valid (finite, in-shape) model or raise."""
    rng = np.random.default_rng(0)
    base, shapes = _payload()
    for _ in range(300):
        payload = {k: v.copy() for k, v in base.items()}
        key = sorted(payload)[int(rng.integers(len(payload)))]
        raw = payload[key].view(np.uint8)
        raw[int(rng.integers(raw.size))] ^= np.uint8(1 << int(rng.integers(8)))
        try:
            params, masks = decode_payload(payload, shapes)
        except SparsePayloadError:
            continue
        for k, shape in shapes.items():
            assert params[k].shape == shape and masks[k].shape == shape
            assert bool(torch.isfinite(params[k]).all())
            assert bool((params[k][~masks[k]] == 0).all())


def test_wire_round_trip_is_exact_with_three_arrays() -> None:
    payload, shapes = _payload()
    wire = pack_parts(payload, sorted(shapes))
    assert sorted(wire) == ["sparse@codes", "sparse@header", "sparse@values"]
    assert wire["sparse@header"].tolist() == [2, 6, 12, 1, 14, 5]  # v: index (uint16), w: bitmask
    back = unpack_parts(wire, shapes)
    assert sorted(back) == sorted(payload)
    for k in payload:
        assert back[k].dtype == payload[k].dtype and np.array_equal(back[k], payload[k])
    params = {"w": torch.arange(1.0, 41.0).reshape(8, 5), "v": torch.arange(1.0, 301.0)}
    masks = {"w": torch.ones(8, 5, dtype=torch.bool), "v": torch.arange(300) < 3}
    got, _ = decode_payload(unpack_parts(to_wire(params, masks), shapes), shapes)
    assert torch.equal(got["w"], params["w"]) and torch.equal(got["v"], params["v"] * masks["v"])


WIRE_MALFORMED = {
    "extra key": lambda w: w.update({"extra": np.zeros(1, np.uint8)}),
    "header of another model": lambda w: w.update({"sparse@header": w["sparse@header"][:3]}),
    "header counts disagree": lambda w: w.update({"sparse@values": w["sparse@values"][:-1]}),
    "codes too long": lambda w: w.update({"sparse@codes": np.append(w["sparse@codes"], np.uint8(0))}),
    "unknown encoding": lambda w: w["sparse@header"].__setitem__(0, 7),
    "odd index bytes": lambda w: (
        w["sparse@header"].__setitem__(2, 11),
        w["sparse@header"].__setitem__(5, 6),
    ),
    "header dtype": lambda w: w.update({"sparse@header": w["sparse@header"].astype(np.int64)}),
}


@pytest.mark.parametrize("case", sorted(WIRE_MALFORMED))
def test_malformed_wire_framing_is_rejected(case: str) -> None:
    payload, shapes = _payload()
    wire = pack_parts(payload, sorted(shapes))
    WIRE_MALFORMED[case](wire)
    with pytest.raises(SparsePayloadError):
        decode_payload(unpack_parts(wire, shapes), shapes)


# --- personalized vs initial-model clients in the federated metric ----------------------------


def test_personalization_split_exact() -> None:
    accs = {"a": 0.5, "b": 0.75, "c": 1.0}
    assert personalization_split(accs, {"a", "c"}) == {
        "clients-personalized": 2.0,
        "clients-initial": 1.0,
        "fed-accuracy-personalized": 0.75,
        "fed-accuracy-initial": 0.75,
    }
    # nobody personalized yet: only the initial-model mean
    assert personalization_split({"a": 0.25}, set()) == {
        "clients-personalized": 0.0,
        "clients-initial": 1.0,
        "fed-accuracy-initial": 0.25,
    }

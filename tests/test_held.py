"""Arrays a node holds are sent once (issue 21, item 4): the protocol, the node's store, the server's grid."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from client.held import ArrayStore, held_arrays_mod
from experiment.config import RunConfig
from experiment.held import (
    BUNDLE,
    BUNDLE_ARRAY,
    CACHE,
    HELD,
    HELD_MISSING_CODE,
    HOLDS,
    ORDER,
    array_digest,
    bundle_arrays,
    digest_record,
    digests,
    pop_bundle,
    split_held,
    unbundle_arrays,
)
from experiment.protocol import ARRAYS
from server.app import build_strategy
from strategies.base import HeterogeneousStrategy
from strategies.grid import HeldArrays, HeldArraysGrid
from tests.handlers import LoopGrid, context, task_identity  # noqa: F401  (fixture)

RUN = {"model": "tiny", "tier-memory-mb": "auto", "local-steps": 2, "batch-size": 8}


def _array(values: list[float]) -> Array:
    return Array(np.asarray(values, dtype=np.float32))


# --- the protocol's pure parts ------------------------------------------------------------------


def test_digest_is_blake2b_of_dtype_shape_stype_and_bytes() -> None:
    a = _array([1.0, 2.0, 3.0])
    expected = hashlib.blake2b(b"float32|3|numpy.ndarray|" + a.data, digest_size=16).hexdigest()
    assert a.stype == "numpy.ndarray"
    assert array_digest(a) == expected
    assert array_digest(_array([1.0, 2.0, 3.0])) == expected  # a function of the content only
    assert array_digest(_array([1.0, 2.0, 3.5])) != expected
    assert array_digest(Array(np.asarray([[1.0, 2.0, 3.0]], dtype=np.float32))) != expected  # shape
    assert array_digest(Array(np.asarray([1.0, 2.0, 3.0], dtype=np.float64))) != expected  # dtype


def test_split_held_leaves_out_exactly_what_the_node_holds_unchanged() -> None:
    present = {"emb": "a" * 32, "pos": "b" * 32}
    held, cache = split_held(present, {"emb": "a" * 32, "pos": "c" * 32})
    assert held == {"emb": "a" * 32}
    assert cache == {"pos": "b" * 32}  # changed since the node kept it: sent and marked again
    held, cache = split_held(present, {})
    assert (held, cache) == ({}, present)


def test_digest_records_reject_what_is_no_digest() -> None:
    assert digests(digest_record({"emb": "0" * 32})) == {"emb": "0" * 32}
    with pytest.raises(ValueError, match="'emb': expected a 32-hex-digit digest, got 'x'"):
        digests(ConfigRecord({"emb": "x"}))
    with pytest.raises(ValueError, match="got 5"):
        digests(ConfigRecord({"emb": 5}))


# --- the node's store ---------------------------------------------------------------------------


def test_store_round_trips_and_deletes_a_corrupt_file(tmp_path: Path) -> None:
    store = ArrayStore(tmp_path, max_bytes=10**6)
    a = _array([1.0, 2.0])
    d = array_digest(a)
    assert store.get(d) is None
    store.put(d, a)
    got = store.get(d)
    assert got is not None and np.array_equal(got.numpy(), a.numpy()) and array_digest(got) == d
    path = tmp_path / f"{d}.array"
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")  # one byte flipped
    assert store.get(d) is None and not path.exists()
    path.write_text("not an array")
    assert store.get(d) is None and not path.exists()


def test_store_prunes_least_recently_used_first(tmp_path: Path) -> None:
    arrays = [_array([float(i)] * 100) for i in range(3)]  # about 590 bytes a file (npy + JSON headers)
    store = ArrayStore(tmp_path, max_bytes=1300)
    for i, a in enumerate(arrays):
        assert store.put(array_digest(a), a)
        if i == 1:
            (tmp_path / f"{array_digest(arrays[0])}.array").touch()  # used again: newer than array 1
            import os

            os.utime(tmp_path / f"{array_digest(arrays[1])}.array", (0, 0))
    assert not store.put(array_digest(arrays[2]), arrays[2])  # there already
    assert len(list(tmp_path.glob("*.array"))) == 3  # put never prunes: the mod prunes once a message
    store.prune()
    kept = {p.stem for p in tmp_path.glob("*.array")}
    assert kept == {array_digest(arrays[0]), array_digest(arrays[2])}


def test_bundled_arrays_come_back_bit_for_bit_in_their_order() -> None:
    arrays = {
        "w": Array(np.arange(6, dtype=np.float32).reshape(2, 3)),
        "scalar": Array(np.asarray(2.5, dtype=np.float64)),
        "ids": Array(np.asarray([7, 8, 9], dtype=np.int64)),
        "empty": Array(np.zeros((0, 4), dtype=np.float32)),
    }
    bundle, layout = bundle_arrays(arrays)
    assert (bundle.dtype, bundle.stype) == ("bytes", "bytes")
    assert len(bundle.data) == sum(len(a.data) for a in arrays.values())
    assert layout["ndims"] == [2, 0, 1, 2] and layout["dims"] == [2, 3, 3, 0, 4]
    back = unbundle_arrays(bundle, layout)
    assert list(back) == list(arrays)
    for name, a in arrays.items():
        b = back[name]
        assert (b.dtype, tuple(b.shape), b.stype, bytes(b.data)) == (a.dtype, tuple(a.shape), a.stype, bytes(a.data))
        assert np.array_equal(b.numpy(), a.numpy())
    content = RecordDict({ARRAYS: ArrayRecord({BUNDLE_ARRAY: bundle}), BUNDLE: layout})
    assert pop_bundle(content, ARRAYS) and BUNDLE not in content and list(content[ARRAYS]) == list(arrays)  # type: ignore[arg-type]
    assert not pop_bundle(content, ARRAYS)  # nothing bundled: unchanged


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"sizes": [1]}, "differ in length"),
        ({"sizes": [4, 4]}, "'sizes' add up to 8 bytes"),
        ({"dims": [2]}, "'ndims' add up to 2 but 'dims' has 1"),
        ({"names": ["a", "a"]}, "appears twice"),
        ({"ndims": [1, -1]}, "non-negative integers"),
        ({"dtypes": "float32"}, "list of strings"),
    ],
)
def test_malformed_bundle_layouts_are_refused_naming_the_problem(change: dict[str, object], names: str) -> None:
    bundle, layout = bundle_arrays({"a": _array([1.0]), "b": _array([2.0, 3.0])})
    bad = ConfigRecord(dict(layout) | change)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=names):
        unbundle_arrays(bundle, bad)


@pytest.mark.usefixtures("task_identity")
def test_a_pushed_message_is_bundled_even_empty_and_resent_whole_unbundled() -> None:
    emb, w = _array([1.0] * 2048), _array([2.0])
    held = HeldArrays(bundle=True)
    held.holds[5] = {"emb": array_digest(emb)}
    arrays = ArrayRecord({"emb": emb, "w": w})
    msg = Message(RecordDict({ARRAYS: arrays, **held.prepare(5, arrays)}), dst_node_id=5, message_type="train")
    assert list(arrays) == ["w"]  # prepare leaves out what the node holds; the strategy sees no bundle
    held.bundle_message(msg)
    held.bundle_message(msg)  # once only
    assert list(msg.content[ARRAYS]) == [BUNDLE_ARRAY] and msg.content[BUNDLE]["names"] == ["w"]  # type: ignore[index,arg-type]
    assert msg.content[ORDER]["names"] == ["emb", "w"] and HELD in msg.content  # type: ignore[index]
    again = held.whole(msg)  # the node lost its copy: everything, unbundled, in order
    assert BUNDLE not in again.content and list(again.content[ARRAYS]) == ["emb", "w"]  # type: ignore[arg-type]
    assert 5 not in held.holds  # the server forgets what a node that lost its copy held
    held.holds[5] = {"emb": array_digest(emb)}
    nothing = ArrayRecord({"emb": emb})
    empty = Message(RecordDict({ARRAYS: nothing, **held.prepare(5, nothing)}), dst_node_id=5, message_type="train")
    held.bundle_message(empty)
    sent = empty.content[ARRAYS]
    assert isinstance(sent, ArrayRecord) and len(sent[BUNDLE_ARRAY].data) == 0
    assert empty.content[BUNDLE]["names"] == []  # type: ignore[index]
    off = HeldArrays(bundle=False)
    plain = Message(RecordDict({ARRAYS: ArrayRecord({"emb": emb, "w": w})}), dst_node_id=5, message_type="train")
    off.bundle_message(plain)
    assert BUNDLE not in plain.content and list(plain.content[ARRAYS]) == ["emb", "w"]  # type: ignore[arg-type]


@pytest.mark.usefixtures("task_identity")
def test_a_reply_whose_bundle_does_not_unbundle_is_left_bundled_for_validation_to_reject() -> None:
    bundle, layout = bundle_arrays({"a": _array([1.0]), "b": _array([2.0, 3.0])})
    layout["sizes"] = [1, 1]
    reply = Message(
        RecordDict({ARRAYS: ArrayRecord({BUNDLE_ARRAY: bundle}), BUNDLE: layout}), dst_node_id=0, message_type="train"
    )
    HeldArrays().received(reply)
    assert BUNDLE not in reply.content and list(reply.content[ARRAYS]) == [BUNDLE_ARRAY]  # type: ignore[arg-type]


# --- the ClientApp mod --------------------------------------------------------------------------


def _echo(msg: Message, _ctx: object) -> Message:
    arrays = msg.content[ARRAYS]
    assert isinstance(arrays, ArrayRecord)
    return Message(RecordDict({"seen": ArrayRecord(dict(arrays.items()))}), reply_to=msg)


@pytest.mark.usefixtures("task_identity")
def test_mod_keeps_marked_arrays_and_restores_held_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETFL_HELD_ARRAYS_DIR", str(tmp_path))
    emb, w = _array([1.0, 2.0]), _array([3.0])
    d = array_digest(emb)
    first = Message(
        RecordDict({ARRAYS: ArrayRecord({"emb": emb, "w": w}), CACHE: digest_record({"emb": d})}),
        dst_node_id=7,
        message_type="train",
    )
    reply = held_arrays_mod(first, context(RUN), _echo)
    assert digests(reply.content[HOLDS]) == {"emb": d}  # type: ignore[arg-type]
    assert CACHE not in first.content  # handlers never see the protocol's records
    second = Message(
        RecordDict(
            {
                ARRAYS: ArrayRecord({"w": w}),
                HELD: digest_record({"emb": d}),
                ORDER: ConfigRecord({"names": ["emb", "w"]}),
            }
        ),
        dst_node_id=7,
        message_type="train",
    )
    reply = held_arrays_mod(second, context(RUN), _echo)
    seen = reply.content["seen"]
    assert isinstance(seen, ArrayRecord) and list(seen) == ["emb", "w"]  # in the order the server built
    assert np.array_equal(seen["emb"].numpy(), emb.numpy())
    assert digests(reply.content[HOLDS]) == {"emb": d}  # type: ignore[arg-type]


@pytest.mark.usefixtures("task_identity")
def test_mod_answers_a_lost_array_with_the_missing_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETFL_HELD_ARRAYS_DIR", str(tmp_path))
    msg = Message(
        RecordDict({ARRAYS: ArrayRecord({"w": _array([3.0])}), HELD: digest_record({"emb": "f" * 32})}),
        dst_node_id=7,
        message_type="train",
    )
    reply = held_arrays_mod(msg, context(RUN), _echo)
    assert reply.has_error() and reply.error.code == HELD_MISSING_CODE
    assert reply.error.reason == "held arrays missing: emb"


@pytest.mark.usefixtures("task_identity")
def test_mod_with_keeping_off_holds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETFL_HELD_ARRAYS_DIR", "")
    emb = _array([1.0])
    msg = Message(
        RecordDict({ARRAYS: ArrayRecord({"emb": emb}), CACHE: digest_record({"emb": array_digest(emb)})}),
        dst_node_id=7,
        message_type="train",
    )
    assert HOLDS not in held_arrays_mod(msg, context(RUN), _echo).content


# --- the server's side, with the real ClientApp in-process ----------------------------------------


def _run(
    rounds: int, *, store: Path, wipe_before: int | None = None, min_bytes: int | None = None, grids: list | None = None
) -> tuple[HeterogeneousStrategy, list[dict[str, list[int]]]]:
    """``rounds`` rounds of train + federated evaluation on 3 nodes; bytes pushed per round and kind."""
    cfg = RunConfig.model_validate(RUN | {"fraction-evaluate": 1.0})
    strategy = build_strategy(cfg)
    if min_bytes is not None:
        strategy.held = HeldArrays(min_bytes)
    init = cfg.family().initial_states(cfg.catalog, seed=0)
    arrays = strategy.set_state({v.name: init[v.name] for v in cfg.training_catalog})
    inner = LoopGrid(RUN, nodes=3)
    if grids is not None:
        grids.append(inner)
    grid = HeldArraysGrid(inner, strategy.held, poll_interval=0.0)  # type: ignore[arg-type]
    pushed: list[dict[str, list[int]]] = []
    for rnd in range(1, rounds + 1):
        if rnd == wipe_before:
            for p in store.glob("*.array"):
                p.unlink()
        pushed.append({})
        for kind in ("train", "evaluate"):
            inner.pushed_bytes = []
            configure = strategy.configure_train if kind == "train" else strategy.configure_evaluate
            msgs = list(configure(rnd, arrays, ConfigRecord(), grid))  # type: ignore[arg-type]
            replies = list(grid.send_and_receive(msgs))
            ids = sorted(m.metadata.message_id for m in msgs)
            assert sorted(r.metadata.reply_to_message_id for r in replies) == ids
            assert all(not r.has_error() and HOLDS not in r.content for r in replies)
            if kind == "train":
                result = strategy.aggregate_train(rnd, replies)
                assert result is not None and result[0] is not None
                arrays = result[0]
            else:
                assert strategy.aggregate_evaluate(rnd, replies) is not None
            pushed[-1][kind] = inner.pushed_bytes
    return strategy, pushed


@pytest.mark.usefixtures("task_identity")
def test_each_array_reaches_a_node_once_and_the_model_is_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HETFL_HELD_ARRAYS_DIR", str(tmp_path / "store"))
    grids: list[LoopGrid] = []
    strategy, pushed = _run(2, store=tmp_path / "store", grids=grids)
    # what is sent travels bundled: round 2's training messages are one array (every weight matrix
    # held), every training reply is one array however many the variant trains
    assert grids[0].pushed_names[-6:-3] == [[BUNDLE_ARRAY]] * 3
    assert grids[0].reply_names and all(names == [BUNDLE_ARRAY] for names in grids[0].reply_names)
    assert len(strategy.held.holds) == 3  # every node said it holds the (frozen) word embeddings
    assert all("bert.embeddings.word_embeddings.weight" in h for h in strategy.held.holds.values())
    first, second = pushed
    # round 1's training message carries every array; later ones leave the embeddings out
    assert all(b < a - 3_000_000 for a, b in zip(sorted(first["train"]), sorted(first["evaluate"]), strict=True))
    # round 2's training message leaves out what round 1's evaluation delivered unchanged: it
    # carries only the arrays under MIN_HELD_BYTES (biases, norms: 5-7 % of the evaluation message)
    pairs = list(zip(sorted(second["train"]), sorted(first["evaluate"]), strict=True))
    assert all(t < 0.1 * e for t, e in pairs), pairs
    monkeypatch.setenv("HETFL_HELD_ARRAYS_DIR", "")  # keeping off: every array in every message
    plain, plain_pushed = _run(2, store=tmp_path / "none")
    assert sorted(plain_pushed[1]["train"]) == sorted(first["train"])
    for variant, tensors in strategy.state.items():
        for name, t in tensors.items():
            assert np.array_equal(t.numpy(), plain.state[variant][name].numpy()), (variant, name)
    # every array keepable: the training message after the evaluation that delivered the same
    # global model carries no array at all
    monkeypatch.setenv("HETFL_HELD_ARRAYS_DIR", str(tmp_path / "all"))
    keep_all, keep_all_pushed = _run(2, store=tmp_path / "all", min_bytes=0)
    assert keep_all_pushed[1]["train"] == [0, 0, 0]
    for variant, tensors in keep_all.state.items():
        for name, t in tensors.items():
            assert np.array_equal(t.numpy(), plain.state[variant][name].numpy()), (variant, name)


@pytest.mark.usefixtures("task_identity")
def test_a_node_that_lost_its_copy_gets_the_message_again_in_the_same_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HETFL_HELD_ARRAYS_DIR", str(tmp_path / "store"))
    strategy, pushed = _run(2, wipe_before=2, store=tmp_path / "store")
    train = pushed[1]["train"]
    assert len(train) == 6  # 3 messages without the embeddings, refused, then 3 whole ones
    assert sorted(train[3:]) == sorted(pushed[0]["train"])
    report = strategy.report(2)
    assert not report.failed and not report.rejected
    assert len(strategy.held.holds) == 3  # kept again from the whole messages


class SilentGrid:
    """Accepts every message, never answers."""

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        return [f"m{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return []


@pytest.mark.usefixtures("task_identity")
def test_what_was_kept_for_an_unanswered_message_is_dropped() -> None:
    held = HeldArrays(min_bytes=0)
    emb = _array([1.0, 2.0])
    held.holds[5] = {"emb": array_digest(emb)}
    arrays = ArrayRecord({"emb": emb, "w": _array([3.0])})
    msg = Message(RecordDict({ARRAYS: arrays, **held.prepare(5, arrays)}), dst_node_id=5, message_type="train")
    assert held._left_out  # kept to resend the message whole if the node lost "emb"
    grid = HeldArraysGrid(SilentGrid(), held, poll_interval=0.0)  # type: ignore[arg-type]
    assert list(grid.send_and_receive([msg], timeout=0.0)) == []
    assert not held._left_out and not grid._pushed

"""PFedKnow strategy glue with the real client round (no Ray): sparse down/up, personal models, rejections."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MessageType
from flwr.supercore.task_identity import TaskIdentity

from client.pfedknow import pfedknow_round
from models.cnn import width_catalog
from models.family import CNNFamily
from models.sparse import index_dtype, pack_parts, unpack_parts
from models.training import TrainSettings
from strategies.pfedknow import PFedKnow
from strategies.pfedknow_modes import MODES, PFedKnowSettings
from strategies.profiles import NodeProfile
from strategies.records import record_nbytes, to_record
from strategies.replies import Sent
from tests.toy import reply

CAT = width_catalog("conv", [("iot", 1.0)], in_channels=1, num_classes=3, image_size=8, batch_size=4, base=(4, 6))
FAMILY = CNNFamily(name="conv", base=(4, 6), in_channels=1, num_classes=3)
TEACHER = CNNFamily(name="conv", base=(8, 12), in_channels=1, num_classes=3)
SHAPES = {p.name: tuple(p.shape) for p in CAT.largest.layout}
NODES = (11, 12, 13)
GEN = torch.Generator().manual_seed(0)
LABELED = (torch.randn(48, 1, 8, 8, generator=GEN), torch.randint(0, 3, (48,), generator=GEN))
CLIENT_X = {n: torch.randn(30, 1, 8, 8, generator=GEN) for n in NODES}
SETTINGS = TrainSettings(optimizer="sgd", lr=0.05, local_steps=3)


@pytest.fixture(autouse=True)
def _task(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # Messages need a run and a node outside a ServerApp
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: extra threads only add contention on shared CPUs
    yield
    torch.set_num_threads(threads)


def make(method: str = "pfedknow", **kw: object) -> PFedKnow:
    s = PFedKnow(
        catalog=CAT,
        mode=MODES[method],
        build_model=lambda: FAMILY.build(CAT.largest),
        build_teacher=lambda: TEACHER.at_rate(1.0),
        labeled=LABELED,
        settings=PFedKnowSettings(
            target_ratio=0.5,
            ramp_rounds=2,
            delta=1.0,  # keep every pseudo-label (untrained tiny models are uncertain)
            distill_steps=3,
            distill_batch_size=8,
            teacher_steps=4,
            init_steps=4,
        ),
        **kw,  # type: ignore[arg-type]
    )
    s.set_state(FAMILY.initial_states(CAT, seed=0))
    s.profiles = {n: NodeProfile(n, "iot", 100.0, 30, False, "iot", "", key=f"partition-{n}") for n in NODES}
    return s


def send(s: PFedKnow, server_round: int, nodes: tuple[int, ...] = NODES) -> dict[int, Sent]:
    """What configure_train does: prepare the round (initialize once), then per-node sparse messages."""
    s.prepare_round(server_round)
    s._sent_train = s._messages(list(nodes), server_round, ConfigRecord(), MessageType.TRAIN)
    for i, rec in enumerate(s._sent_train.values()):
        rec.message.metadata.__dict__["_message_id"] = f"r{server_round}-m{i}"  # what push_messages fills in
    return {rec.node_id: rec for rec in s._sent_train.values()}


def client_upload(rec: Sent, node: int, server_round: int) -> ArrayRecord:
    arrays = rec.message.content["arrays"]
    cfg = rec.message.content["config"]
    assert isinstance(arrays, ArrayRecord) and isinstance(cfg, ConfigRecord)
    payload = {k: np.asarray(a.numpy()) for k, a in arrays.items()}
    upload, metrics = pfedknow_round(
        FAMILY.build(CAT.largest), payload, SHAPES, CLIENT_X[node], cfg, settings=SETTINGS, batch_size=8, seed=node
    )
    assert metrics["pseudo-kept"] == 30.0
    return ArrayRecord({k: Array(v) for k, v in upload.items()})


def run_round(s: PFedKnow, server_round: int) -> None:
    sent = send(s, server_round)
    replies = [reply(rec, client_upload(rec, n, server_round), num_examples=30, server_round=server_round)
               for n, rec in sent.items()]  # fmt: skip
    s.aggregate_train(server_round, replies)
    assert s.report(server_round).rejected == []


def test_round_personalizes_every_client_with_sparse_uploads() -> None:
    s = make()
    init = {k: v.clone() for k, v in s.state["iot"].items()}
    sent = send(s, 1)
    assert s.teacher_state is not None
    assert any(not torch.equal(init[k], s.state["iot"][k]) for k in init)  # w_s' was trained on D_s
    cfg = sent[11].message.content["config"]
    assert cfg["prune-ratio"] == pytest.approx(0.25) and cfg["uncertainty"] == "evidential"  # type: ignore[index]
    replies = [reply(rec, client_upload(rec, n, 1), num_examples=30, server_round=1) for n, rec in sent.items()]
    s.aggregate_train(1, replies)
    report = s.report(1)
    assert report.rejected == []
    group = report.groups["iot"]
    assert sorted(s.personal) == ["partition-11", "partition-12", "partition-13"]
    dense = record_nbytes(to_record(s.state["iot"]))
    for key in s.personal:
        assert 0 < group[f"bytes-up:{key}"] < dense  # sparse upload, per client
        assert group[f"bytes-down:{key}"] == group["bytes-down:partition-11"] < dense  # unpruned w_s', packed
        masks = s.masks[key]
        for name, t in s.personal[key].items():
            assert bool((t[~masks[name]] == 0).all())  # the personalized model keeps the client's mask
    assert group["bytes-up-dense"] == 3 * dense
    assert 0.0 < group["upload-saving"] < 1.0
    assert group["distill-kl-teacher"] > 0 and group["distill-kl-helpers"] > 0
    # round 2: each client receives its own pruned model, smaller than the dense one
    sent2 = send(s, 2)
    down = s.report(2).groups["iot"][f"bytes-down:partition-{NODES[0]}"]
    assert down < group[f"bytes-down:partition-{NODES[0]}"]
    assert set(sent2) == set(NODES)
    assert s.prune_ratio(2) == pytest.approx(0.5)


def test_teacher_learns_its_own_set_and_the_student_only_d_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """``teacher_labeled`` (D_s with the public set) trains the teacher; ``w_s'`` is trained on D_s alone."""
    import strategies.pfedknow as module

    public = (torch.randn(20, 1, 8, 8, generator=GEN), torch.randint(0, 3, (20,), generator=GEN))
    teacher_set = (torch.cat([LABELED[0], public[0]]), torch.cat([LABELED[1], public[1]]))
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    train = module.train_on_labeled

    def recording(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, **kw: object) -> list[float]:
        seen.append((x, y))
        return train(model, x, y, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "train_on_labeled", recording)
    s = make(teacher_labeled=teacher_set)
    send(s, 1)
    (tx, ty), (sx, sy) = seen  # the teacher first, then w_s'
    assert tx.shape[0] == 68 and torch.equal(tx, teacher_set[0]) and torch.equal(ty, teacher_set[1])
    assert torch.equal(sx, LABELED[0]) and torch.equal(sy, LABELED[1])
    seen.clear()
    send(make(), 1)  # without teacher_labeled the teacher learns D_s
    assert all(torch.equal(x, LABELED[0]) for x, _ in seen) and len(seen) == 2


def test_personal_models_differ_and_are_evaluated_one_by_one() -> None:
    s = make()
    run_round(s, 1)
    models = s.models_for_evaluation()["iot"]
    assert len(models) == 3
    a, b = (s.personal[f"partition-{n}"] for n in NODES[:2])
    assert any(not torch.equal(a[k], b[k]) for k in a)


def _mutations() -> dict[str, object]:
    def out_of_range(p: dict[str, np.ndarray]) -> None:
        name = next(k for k in sorted(p) if k.endswith("@bitmask")).rpartition("@")[0]
        n = int(np.prod(SHAPES[name]))
        p.pop(f"{name}@bitmask")
        p[f"{name}@index"] = np.full(p[f"{name}@values"].size, n, dtype=index_dtype(n))

    def revive(p: dict[str, np.ndarray]) -> None:
        for k in [k for k in p if k.endswith("@values") or k.endswith("@bitmask") or k.endswith("@index")]:
            name = k.rpartition("@")[0]
            p.pop(f"{name}@values", None), p.pop(f"{name}@bitmask", None), p.pop(f"{name}@index", None)
            p[f"{name}@dense"] = np.ones(int(np.prod(SHAPES[name])), np.float32)

    return {
        "count mismatch": lambda p: p.update({k: v[:-1] for k, v in p.items() if k.endswith("@values")}),
        "index out of range": out_of_range,
        "wrong shape": lambda p: p.update({"classifier.weight@dense": np.zeros(5, np.float32)}),
        "nan": lambda p: p.update({"classifier.bias@dense": np.full(3, np.nan, np.float32)}),
        "revives pruned weights": revive,
    }


@pytest.mark.parametrize("case", sorted(_mutations()))
def test_malformed_uploads_are_rejected_and_state_is_untouched(case: str) -> None:
    s = make()
    run_round(s, 1)
    before = {k: {n: t.clone() for n, t in p.items()} for k, p in s.personal.items()}
    sent = send(s, 2)
    replies = []
    for n, rec in sent.items():
        upload = client_upload(rec, n, 2)
        wire = {k: np.asarray(a.numpy()) for k, a in upload.items()}
        if n == NODES[0]:
            payload = unpack_parts(wire, SHAPES)
            _mutations()[case](payload)  # type: ignore[operator]
            wire = pack_parts(payload, sorted(SHAPES))
        replies.append(reply(rec, ArrayRecord({k: Array(v) for k, v in wire.items()}), server_round=2,
                             num_examples=30))  # fmt: skip
    s.aggregate_train(2, replies)
    rejected = s.report(2).rejected
    assert len(rejected) == 1 and f"node {NODES[0]}" in rejected[0]
    bad = f"partition-{NODES[0]}"
    assert all(torch.equal(before[bad][k], s.personal[bad][k]) for k in before[bad])
    assert s.report(2).groups["iot"]["clients"] == 2


def test_examples_claim_beyond_handshake_is_rejected() -> None:
    s = make()
    sent = send(s, 1)
    rec = sent[NODES[0]]
    s.aggregate_train(1, [reply(rec, client_upload(rec, NODES[0], 1), num_examples=31, server_round=1)])
    assert len(s.report(1).rejected) == 1 and not s.personal


def test_a_node_sent_a_model_and_never_heard_from_is_reported_failed() -> None:
    s = make()
    sent = send(s, 1)
    answered = [reply(rec, client_upload(rec, n, 1), num_examples=30, server_round=1)
                for n, rec in sent.items() if n != NODES[0]]  # fmt: skip
    s.aggregate_train(1, answered)
    failed = s.report(1).failed
    assert len(failed) == 1 and failed[0].startswith(f"node {NODES[0]} ") and "round timeout" in failed[0]
    assert s.report(1).groups["iot"]["clients"] == len(NODES) - 1


def test_update_clipping_is_refused_it_would_revive_pruned_weights() -> None:
    with pytest.raises(ValueError, match="clip-update-norm"):
        make(clip_update_norm={"iot": 1.0})


@pytest.mark.parametrize("method", ["pfedknow-as1", "semifl"])
def test_fedavg_ablations_send_one_dense_global_model(method: str) -> None:
    s = make(method)
    assert s.teacher_state is None
    run_round(s, 1)
    assert s.teacher_state is None and not s.personal and not s.masks
    group = s.report(1).groups["iot"]
    assert group["payload-saving"] == 0.0  # dense uploads: the wire saves only container overhead
    assert "finetune-loss" in group
    assert len(s.models_for_evaluation()["iot"]) == 1
    assert s.report(1).groups["iot"].get("prune-ratio") == 0.0


def test_as2_zero_average_keeps_each_clients_mask() -> None:
    s = make("pfedknow-as2")
    run_round(s, 1)
    assert not s.personal and len(s.masks) == 3
    for key, masks in s.masks.items():
        model = s.client_model(key)
        for name, t in model.items():
            assert bool((t[~masks[name]] == 0).all())
    assert s.report(1).groups["iot"]["upload-saving"] > 0


def test_as3_has_no_teacher_and_as4_no_pruning() -> None:
    s3 = make("pfedknow-as3")
    run_round(s3, 1)
    assert s3.teacher_state is None and s3.report(1).groups["iot"]["distill-kl-teacher"] == 0.0
    s4 = make("pfedknow-as4")
    run_round(s4, 1)
    assert s4.teacher_state is not None
    assert all(bool(m.all()) for ms in s4.masks.values() for m in ms.values())


def test_method_state_round_trip_restores_personal_models() -> None:
    s = make()
    run_round(s, 1)
    data = s.method_state()
    t = make()
    t.load_method_state(data)
    assert t.initialized and t.teacher_state is not None
    assert set(t.personal) == set(s.personal)
    for key in s.personal:
        assert all(torch.equal(s.personal[key][k], t.personal[key][k]) for k in s.personal[key])
        assert all(torch.equal(s.masks[key][k], t.masks[key][k]) for k in s.masks[key])
    with pytest.raises(ValueError):
        t.load_method_state({"personal": {"x": {"nope": torch.zeros(1)}}})

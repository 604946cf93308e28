"""Server checkpoints: atomic, checksummed, compatibility-checked, last ``K`` kept.

After every round the ServerApp writes one file ``round-<t>.ckpt`` holding the complete
server state after round ``t`` (see :func:`server.app.main`): the strategy's
:meth:`~strategies.base.HeterogeneousStrategy.checkpoint_state` (composite model, server
optimizer and method state, sampling RNG), the process RNG states and the results rows
written so far.

File format (one file per round)::

    {"magic": "hetfl-checkpoint", "version": 1, "round": t, "size": n,
     "fingerprint": {...}, "sha256": h}<newline>
    <n bytes: torch.save(payload)>

with ``h = sha256(canonical header without "sha256" || payload)``, so a flipped bit in the
header or the payload, or a truncated file, is detected before anything is unpickled.
The payload is read with ``torch.load(weights_only=True)`` (tensors, dicts, lists,
tuples, numbers and strings only; no code runs on load).

A write goes to a hidden temporary file in the same folder, is flushed and ``fsync``-ed,
then renamed over the final name (``os.replace`` is atomic on POSIX) and the folder is
``fsync``-ed: a crash leaves either the previous set of checkpoints or the new one, never
a half-written ``round-*.ckpt``.

Compatibility is a :class:`Fingerprint` = method + model + catalog (every variant's name
and every tensor's name, shape, dtype and trainable flag).  A checkpoint whose fingerprint
differs is refused with :class:`CheckpointIncompatible`, naming what differs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from logging import WARNING
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.common import log

from models.catalog import VariantCatalog

MAGIC = "hetfl-checkpoint"
FORMAT_VERSION = 1
_NAME = re.compile(r"^round-(\d{6})\.ckpt$")
#: The header line is small; anything longer is not a checkpoint.
_MAX_HEADER = 1 << 16


class CheckpointError(Exception):
    """A checkpoint cannot be used; ``str(exc)`` says which file and why."""


class CheckpointCorrupt(CheckpointError):
    """The file is truncated, not a checkpoint, or fails its checksum."""


class CheckpointIncompatible(CheckpointError):
    """The checkpoint belongs to another method, model or catalog (or format version)."""


@dataclass(frozen=True)
class Fingerprint:
    """What a checkpoint must match to be resumed.

    Attributes
    ----------
    method : str
        The run's ``method``.
    model : str
        The run's ``model``.
    variants : tuple[str, ...]
        Catalog variant names, smallest first.
    layouts : str
        ``sha256`` of every variant's layout (tensor names, shapes, dtypes, trainable flags).

    """

    method: str
    model: str
    variants: tuple[str, ...]
    layouts: str

    def to_json(self) -> dict[str, Any]:
        """JSON-able form (stored in the header)."""
        return {**asdict(self), "variants": list(self.variants)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Fingerprint:
        """Inverse of :meth:`to_json`; raise :class:`CheckpointCorrupt` on a malformed entry."""
        try:
            return cls(str(data["method"]), str(data["model"]), tuple(map(str, data["variants"])), str(data["layouts"]))
        except (KeyError, TypeError) as exc:
            raise CheckpointCorrupt(f"malformed fingerprint {data!r}") from exc

    def differences(self, other: Fingerprint) -> list[str]:
        """Human-readable list of what differs from ``other`` (empty when equal)."""
        out = []
        for key in ("method", "model", "variants"):
            mine, theirs = getattr(self, key), getattr(other, key)
            if mine != theirs:
                out.append(f"{key} {theirs!r} (this run: {mine!r})")
        if self.layouts != other.layouts and self.variants == other.variants:
            out.append("variant layouts (tensor names/shapes) differ")
        return out


def fingerprint(method: str, model: str, catalog: VariantCatalog) -> Fingerprint:
    """Fingerprint of a run: ``method``, ``model`` and the catalog's layouts.

    ``layouts = sha256(json([(variant, [(name, shape, dtype, trainable), ...]), ...]))``.
    """
    desc = [[v.name, [[p.name, list(p.shape), p.dtype, bool(p.trainable)] for p in v.layout]] for v in catalog]
    digest = hashlib.sha256(json.dumps(desc, separators=(",", ":")).encode()).hexdigest()
    return Fingerprint(method, model, tuple(catalog.names()), digest)


@dataclass
class Checkpoint:
    """A verified checkpoint: the round it was written after, its fingerprint and payload."""

    path: Path
    server_round: int
    fingerprint: Fingerprint
    payload: dict[str, Any]


def checkpoint_path(folder: Path, server_round: int) -> Path:
    """``<folder>/round-<t, 6 digits>.ckpt``."""
    if not 0 <= server_round < 10**6:
        raise ValueError(f"server_round must be in [0, 10^6), got {server_round}")
    return folder / f"round-{server_round:06d}.ckpt"


def _digest(header: Mapping[str, Any], payload: bytes) -> str:
    canonical = json.dumps({k: v for k, v in header.items() if k != "sha256"}, sort_keys=True).encode()
    return hashlib.sha256(canonical + b"\n" + payload).hexdigest()


def encode_checkpoint(server_round: int, payload: Mapping[str, Any], fp: Fingerprint) -> bytes:
    """Header line + ``torch.save(payload)`` bytes (see the module docstring)."""
    buf = io.BytesIO()
    torch.save(dict(payload), buf)
    body = buf.getvalue()
    header: dict[str, Any] = {
        "magic": MAGIC,
        "version": FORMAT_VERSION,
        "round": server_round,
        "size": len(body),
        "fingerprint": fp.to_json(),
    }
    header["sha256"] = _digest(header, body)
    return json.dumps(header, sort_keys=True).encode() + b"\n" + body


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a directory be opened
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_checkpoint(folder: Path, server_round: int, payload: Mapping[str, Any], fp: Fingerprint) -> Path:
    """Atomically write the checkpoint of ``server_round``; return its path.

    The bytes go to ``.round-<t>.ckpt.tmp`` (flushed and ``fsync``-ed), which is then renamed
    over ``round-<t>.ckpt``; the folder is ``fsync``-ed after the rename.
    """
    folder.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(folder, server_round)
    tmp = folder / f".{final.name}.tmp"
    data = encode_checkpoint(server_round, payload, fp)
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(folder)
    return final


def decode_checkpoint(data: bytes, *, source: str = "<bytes>") -> tuple[dict[str, Any], bytes]:
    """Split and verify ``header, payload``; raise :class:`CheckpointCorrupt` or :class:`CheckpointIncompatible`."""
    newline = data.find(b"\n", 0, _MAX_HEADER)
    if newline < 0:
        raise CheckpointCorrupt(f"{source}: no checkpoint header")
    try:
        header = json.loads(data[:newline])
    except ValueError as exc:
        raise CheckpointCorrupt(f"{source}: unreadable header ({exc})") from exc
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise CheckpointCorrupt(f"{source}: not a hetfl checkpoint")
    if header.get("version") != FORMAT_VERSION:
        raise CheckpointIncompatible(
            f"{source}: checkpoint format version {header.get('version')!r}, this code reads {FORMAT_VERSION}"
        )
    body = data[newline + 1 :]
    if len(body) != header.get("size"):
        raise CheckpointCorrupt(f"{source}: payload is {len(body)} bytes, header says {header.get('size')!r}")
    if _digest(header, body) != header.get("sha256"):
        raise CheckpointCorrupt(f"{source}: checksum mismatch (file damaged)")
    return header, body


def read_checkpoint(path: Path, expected: Fingerprint | None = None) -> Checkpoint:
    """Read, verify and (when ``expected`` is given) compatibility-check one checkpoint.

    Raises
    ------
    CheckpointCorrupt
        Unreadable, truncated or failing its checksum.
    CheckpointIncompatible
        Another format version, or a fingerprint different from ``expected``.

    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointCorrupt(f"{path}: cannot read ({exc})") from exc
    header, body = decode_checkpoint(data, source=str(path))
    fp = Fingerprint.from_json(header.get("fingerprint", {}))
    if expected is not None and fp != expected:
        raise CheckpointIncompatible(
            f"{path} was written by another run: {'; '.join(expected.differences(fp))}. "
            "Use another checkpoint-dir (or run without resume)."
        )
    try:
        payload = torch.load(io.BytesIO(body), weights_only=True)
    except Exception as exc:  # the checksum matched, so this is a writer/reader mismatch
        raise CheckpointCorrupt(f"{path}: payload does not load ({exc})") from exc
    if not isinstance(payload, dict):
        raise CheckpointCorrupt(f"{path}: payload is a {type(payload).__name__}, expected a dict")
    return Checkpoint(path, int(header["round"]), fp, payload)


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """``(round, path)`` of every ``round-*.ckpt`` in ``folder``, oldest first (temporaries ignored)."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name)) and p.is_file()]
    return sorted(found)


def prune_checkpoints(folder: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints (and stale temporaries); return what was deleted."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    removed = [p for _, p in list_checkpoints(folder)[:-keep]]
    removed += [p for p in folder.glob(".round-*.ckpt.tmp") if p.is_file()] if folder.is_dir() else []
    for p in removed:
        p.unlink(missing_ok=True)
    return removed


def clear_checkpoints(folder: Path) -> list[Path]:
    """Delete every checkpoint in ``folder`` (a fresh run must not resume an older run's files)."""
    removed = [p for _, p in list_checkpoints(folder)]
    for p in removed:
        p.unlink(missing_ok=True)
    return removed


def latest_checkpoint(folder: Path, expected: Fingerprint) -> Checkpoint | None:
    """The newest checkpoint in ``folder`` that verifies, or ``None`` when there is none.

    A corrupt file is skipped with a warning naming it and the next older one is tried
    (the last *good* checkpoint); an incompatible one stops the search.

    Raises
    ------
    CheckpointIncompatible
        The newest readable checkpoint belongs to another method / model / catalog.
    CheckpointCorrupt
        Checkpoints exist but every one of them is corrupt.

    """
    found = list_checkpoints(folder)
    reasons = []
    for _, path in reversed(found):
        try:
            return read_checkpoint(path, expected)
        except CheckpointCorrupt as exc:
            log(WARNING, "checkpoint refused: %s", exc)
            reasons.append(str(exc))
    if reasons:
        raise CheckpointCorrupt(f"no usable checkpoint in {folder}: " + "; ".join(reasons))
    return None


def capture_rng(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """States of Python's ``random``, NumPy's global RNG, torch's CPU RNG and named ``generators``."""
    state = np.random.get_state(legacy=True)
    if not isinstance(state, tuple):  # legacy=True always gives the 5-tuple; a dict means another bit generator
        raise CheckpointError(f"NumPy's global RNG state is not the legacy MT19937 tuple: {type(state).__name__}")
    name, keys, pos, has_gauss, cached = state
    return {
        "python": random.getstate(),
        "numpy": (
            str(name),
            torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ),
        "torch": torch.get_rng_state(),
        "generators": {k: g.get_state() for k, g in (generators or {}).items()},
    }


def restore_rng(states: Mapping[str, Any], generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Inverse of :func:`capture_rng`; a named generator missing from ``states`` is left as is.

    Raises
    ------
    ValueError
        When a state is malformed.

    """
    try:
        random.setstate(states["python"])
        name, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(states["torch"])
        saved = states.get("generators", {})
        for key, gen in (generators or {}).items():
            if key in saved:
                gen.set_state(saved[key])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"RNG states are unusable ({exc})") from exc

"""The node's side of :mod:`experiment.held`: a content-addressed array store and the ClientApp mod.

The store keeps each array the server marked for keeping in one file named by its digest, under
the node config's ``held-arrays-dir``, else ``$HETFL_HELD_ARRAYS_DIR``, else
``~/.cache/hetfl/held-arrays`` (an empty value turns keeping off: the node then never says it
holds anything and always receives every array).  A file is written to a temporary name and
renamed, so concurrent ClientApps (forked per message, or Ray actors sharing a machine) never read
a partial file; it is checked against its digest on every read, and a file that fails the check is
deleted and reported missing.  Files the server never refers to again are removed oldest first once
the store holds more than ``HETFL_HELD_ARRAYS_MAX_MB`` (default 2048) MiB.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from logging import INFO, WARNING
from pathlib import Path

from flwr.app import Array, ArrayRecord, Context, Error, Message
from flwr.common import log

from experiment.held import (
    BUNDLE,
    BUNDLE_ARRAY,
    CACHE,
    HELD,
    HELD_MISSING_CODE,
    HELD_MISSING_REASON,
    HOLDS,
    ORDER,
    array_digest,
    bundle_arrays,
    digest_record,
    pop_bundle,
    pop_digests,
    pop_order,
)
from experiment.protocol import ARRAYS

DEFAULT_MAX_MB = 2048.0


class ArrayStore:
    """Arrays on disk, one file per digest: a JSON header line (dtype, shape, stype), then the bytes."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes

    def _path(self, digest: str) -> Path:
        return self.root / f"{digest}.array"

    def get(self, digest: str) -> Array | None:
        """The stored array of ``digest``, or ``None`` (absent, unreadable or failing its digest: deleted)."""
        path = self._path(digest)
        try:
            raw = path.read_bytes()
            head, data = raw.split(b"\n", 1)
            meta = json.loads(head)
            array = Array(dtype=meta["dtype"], shape=tuple(meta["shape"]), stype=meta["stype"], data=data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log(WARNING, "held array %s unreadable (%s): deleted", digest, exc)
            path.unlink(missing_ok=True)
            return None
        if array_digest(array) != digest:
            log(WARNING, "held array %s does not match its digest: deleted", digest)
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # most recently used: pruned last
        return array

    def put(self, digest: str, array: Array) -> bool:
        """Store ``array`` under ``digest`` (atomically); ``False`` if it was there already."""
        path = self._path(digest)
        if path.exists():
            os.utime(path)
            return False
        self.root.mkdir(parents=True, exist_ok=True)
        head = json.dumps({"dtype": array.dtype, "shape": list(array.shape), "stype": array.stype}).encode()
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(head + b"\n")
                f.write(array.data)
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
        return True

    def prune(self) -> None:
        """Delete the least recently used files until the store holds at most ``max_bytes``.

        Several ClientApps of a machine share a store and prune it at once: a file another one
        deleted meanwhile is skipped, never an error.
        """
        found = []
        for p in self.root.glob("*.array"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            found.append((st.st_mtime, st.st_size, p))
        found.sort(key=lambda f: f[0])
        total = sum(size for _, size, _ in found)
        for _, size, p in found:
            if total <= self.max_bytes:
                break
            total -= size
            p.unlink(missing_ok=True)


def store_for(context: Context) -> ArrayStore | None:
    """This node's store (``held-arrays-dir`` node config, ``$HETFL_HELD_ARRAYS_DIR``, default), or ``None`` if off."""
    configured = context.node_config.get("held-arrays-dir", os.environ.get("HETFL_HELD_ARRAYS_DIR"))
    if configured is not None and str(configured) == "":
        return None
    root = Path(str(configured)) if configured is not None else Path.home() / ".cache" / "hetfl" / "held-arrays"
    max_mb = float(os.environ.get("HETFL_HELD_ARRAYS_MAX_MB", DEFAULT_MAX_MB))
    return ArrayStore(root.expanduser(), int(max_mb * 2**20))


def held_arrays_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Unbundle the message, put held arrays back, keep the marked ones; say what the node holds, bundle the reply.

    Runs before every handler (``ClientApp(mods=[...])``), so handlers always see whole messages.
    A left-out array the store lacks is answered with the error :data:`HELD_MISSING_CODE`
    (the server then sends the message again in full).
    """
    if msg.has_error() or not any(key in msg.content for key in (HELD, CACHE, BUNDLE)):
        return call_next(msg, context)
    bundled = pop_bundle(msg.content, ARRAYS)
    held, cache, order = pop_digests(msg.content, HELD), pop_digests(msg.content, CACHE), pop_order(msg.content)
    store = store_for(context)
    arrays = msg.content.get(ARRAYS)
    if not isinstance(arrays, ArrayRecord):
        raise ValueError(f"message names held or cacheable arrays but has no {ARRAYS!r} ArrayRecord")
    missing = []
    for name, digest in held.items():
        array = store.get(digest) if store is not None else None
        if array is None:
            missing.append(name)
        else:
            arrays[name] = array
    if missing:
        log(WARNING, "%s: %s; asking the server for the whole message", HELD_MISSING_REASON, ", ".join(missing))
        return Message(
            Error(code=HELD_MISSING_CODE, reason=f"{HELD_MISSING_REASON}: {', '.join(missing)}"), reply_to=msg
        )
    if order is not None:  # the record as the server built it, arrays in their order
        if set(order) != set(arrays.keys()):
            raise ValueError(f"record {ORDER!r} names other arrays than the message holds once restored")
        msg.content[ARRAYS] = arrays = ArrayRecord({name: arrays[name] for name in order})
    holds = dict(held)
    if store is not None:
        written = False
        for name, digest in cache.items():
            if name in arrays and array_digest(arrays[name]) == digest:
                written |= store.put(digest, arrays[name])
                holds[name] = digest
        if written:
            store.prune()
    if held:
        log(INFO, "restored %d held array(s) from %s", len(held), store.root if store is not None else "-")
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    if holds:
        reply.content[HOLDS] = digest_record(holds)
    sent = reply.content.get(ARRAYS)
    if bundled and isinstance(sent, ArrayRecord):  # answered in kind: the server unbundles
        bundle, layout = bundle_arrays(dict(sent.items()))
        reply.content[ARRAYS] = ArrayRecord({BUNDLE_ARRAY: bundle})
        reply.content[BUNDLE] = layout
    return reply

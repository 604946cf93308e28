"""Arrays a node already holds: sent once per run, referred to by digest afterwards (issue 21, item 4).

Every MiniLM message used to carry the frozen word-embedding matrix (44.7 MiB of a 62.5 MB weak
message) although no tier trains it and the node received the same bytes the round before.  The
protocol that avoids it, shared by both apps:

1. The server marks the arrays a node may keep in a record :data:`CACHE` of the outgoing message
   (``name -> digest``): every array of at least :data:`MIN_HELD_BYTES` (smaller ones cost less
   to resend than to name).  Frozen arrays (MiniLM's word embeddings) then travel once per run,
   and a global model a node received for evaluation is not sent again for the next round's
   training.
2. The ClientApp's mod (:mod:`client.held`) stores a marked array under its digest (after checking
   it) and lists what it now holds in a reply record :data:`HOLDS` (``name -> digest``).
3. Once a node's reply said it holds ``name`` with digest ``d``, a later message to that node
   whose array ``name`` still has digest ``d`` omits it and names it in a record :data:`HELD`
   instead (and lists the message's array names in order in :data:`ORDER`); the mod puts the
   stored array back, in its place, before any handler runs.
4. A node that lost its copy (a new machine, a wiped cache, a corrupt file) answers with the
   error :data:`HELD_MISSING_CODE`; the server forgets what that node held and sends the same
   message again in full, in the same round (:class:`strategies.grid.HeldArraysGrid`).

The digest (:func:`array_digest`) covers an array's dtype, shape, storage type and bytes, so a
changed array is never confused with a stored one: correctness never rests on which arrays are
frozen or when the model changes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Final

from flwr.app import Array, ConfigRecord, RecordDict
from flwr.app.typing import ConfigRecordValues

#: message record: ``name -> digest`` of arrays left out (the node holds them).
HELD: Final = "held-arrays"
#: message record (with :data:`HELD`): ``{"names": [...]}``, every array name of the message in
#: its order, so the node restores the record exactly as it was built.
ORDER: Final = "held-arrays-order"
#: message record: ``name -> digest`` of arrays the node may keep for later messages.
CACHE: Final = "cache-arrays"
#: reply record: ``name -> digest`` of the arrays the node holds after this message.
HOLDS: Final = "holds-arrays"
#: ``Error.code`` of a reply whose node lacks an array the message left out.
HELD_MISSING_CODE: Final = 1021
HELD_MISSING_REASON: Final = "held arrays missing"
#: arrays smaller than this (bytes) are always sent: biases and norms, whose digest and name cost
#: about 2 % of their size; every weight matrix of the tiny model and of MiniLM is larger.
MIN_HELD_BYTES: Final = 4 * 1024


def array_digest(array: Array) -> str:
    """``blake2b-128(dtype | shape | stype | data)`` of a Flower ``Array``, hex.

    Two arrays with the same digest have the same dtype, shape, storage type and bytes (up to a
    128-bit collision).
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{array.dtype}|{','.join(map(str, array.shape))}|{array.stype}|".encode())
    h.update(array.data)
    return h.hexdigest()


def digest_record(names_digests: Mapping[str, str]) -> ConfigRecord:
    """A ``name -> digest`` record (:data:`HELD`, :data:`CACHE`, :data:`HOLDS`)."""
    values: dict[str, ConfigRecordValues] = dict(names_digests)
    return ConfigRecord(values)


def digests(record: ConfigRecord) -> dict[str, str]:
    """A ``name -> digest`` record as a plain dict (every value a 32-hex-digit string, else ``ValueError``)."""
    out: dict[str, str] = {}
    for name, value in record.items():
        if not (isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)):
            raise ValueError(f"record entry {name!r}: expected a 32-hex-digit digest, got {value!r}")
        out[name] = value
    return out


def pop_digests(content: RecordDict, key: str) -> dict[str, str]:
    """Remove record ``key`` from ``content`` and return its digests (``{}`` when absent)."""
    if key not in content:
        return {}
    record = content[key]
    del content[key]
    if not isinstance(record, ConfigRecord):
        raise ValueError(f"record {key!r}: expected a ConfigRecord, got {type(record).__name__}")
    return digests(record)


def split_held(names_digests: Mapping[str, str], holds: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Which arrays of a message to leave out (``held``) and which to mark for keeping (``cache``).

    ``names_digests``: the message's arrays that may be kept, and their digests; ``holds``: what
    the node said it holds.  An array is left out iff the node holds that name with the same
    digest, and marked for keeping otherwise.
    """
    held = {n: d for n, d in names_digests.items() if holds.get(n) == d}
    cache = {n: d for n, d in names_digests.items() if n not in held}
    return held, cache


def pop_order(content: RecordDict) -> list[str] | None:
    """Remove record :data:`ORDER` from ``content``; its names (``None`` when absent, ``ValueError`` if malformed)."""
    if ORDER not in content:
        return None
    record = content[ORDER]
    del content[ORDER]
    names = record.get("names") if isinstance(record, ConfigRecord) else None
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ValueError(f"record {ORDER!r}: expected a ConfigRecord with a list of names under 'names'")
    return [str(n) for n in names]

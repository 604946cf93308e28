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

from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
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


#: message and reply record: the layout of :data:`BUNDLE_ARRAY`, the one array that carries the
#: record's arrays (see :func:`bundle_arrays`).
BUNDLE: Final = "bundled-arrays"
#: the name of the bundle in the :data:`~experiment.protocol.ARRAYS` record.
BUNDLE_ARRAY: Final = "bundle"
_BUNDLE_TYPE: Final = "bytes"


def bundle_arrays(arrays: Mapping[str, Array]) -> tuple[Array, ConfigRecord]:
    """Concatenate ``arrays`` into one array and return it with its layout record.

    Flower sends every ``Array`` as at least two objects (the array and its chunk), each its own
    gRPC call between SuperNode and SuperLink and its own HTTP call on the apps' runtime links
    (about 10 ms each on a loaded loopback): a message of 40 small arrays spent 2-5 s in transfer
    for 0.16 MB (issue 21).  One bundle costs two objects.  The layout keeps, per array in order,
    its name, dtype, storage type, shape (``ndims`` and the flattened ``dims``) and byte size;
    :func:`unbundle_arrays` restores the arrays bit for bit.
    """
    names = list(arrays)
    parts = [arrays[n] for n in names]
    layout = ConfigRecord(
        {
            "names": names,
            "dtypes": [a.dtype for a in parts],
            "stypes": [a.stype for a in parts],
            "ndims": [len(a.shape) for a in parts],
            "dims": [int(d) for a in parts for d in a.shape],
            "sizes": [len(a.data) for a in parts],
        }
    )
    data = b"".join(bytes(a.data) for a in parts)
    return Array(dtype=_BUNDLE_TYPE, shape=(len(data),), stype=_BUNDLE_TYPE, data=data), layout


def _str_list(layout: ConfigRecord, key: str) -> list[str]:
    values = layout.get(key)
    if not (isinstance(values, list) and all(isinstance(v, str) for v in values)):
        raise ValueError(f"bundle layout {key!r}: expected a list of strings")
    return [str(v) for v in values]


def _int_list(layout: ConfigRecord, key: str) -> list[int]:
    values = layout.get(key)
    ok = isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)
    if not ok or not isinstance(values, list):
        raise ValueError(f"bundle layout {key!r}: expected a list of non-negative integers")
    return [int(v) for v in values]


def unbundle_arrays(bundle: Array, layout: ConfigRecord) -> dict[str, Array]:
    """The arrays :func:`bundle_arrays` packed, in their order; ``ValueError`` naming what is malformed.

    Checked: every list present and of one length, names unique, ``sum(ndims) == len(dims)``,
    ``sum(sizes)`` equal to the bundle's byte length.  What the arrays hold is checked where
    they are used (a reply's shapes and values by the strategy's validation).
    """
    if bundle.dtype != _BUNDLE_TYPE or bundle.stype != _BUNDLE_TYPE:
        raise ValueError(f"array {BUNDLE_ARRAY!r} is not a bundle (dtype {bundle.dtype!r}, stype {bundle.stype!r})")
    names, dtypes, stypes = _str_list(layout, "names"), _str_list(layout, "dtypes"), _str_list(layout, "stypes")
    ndims, dims, sizes = _int_list(layout, "ndims"), _int_list(layout, "dims"), _int_list(layout, "sizes")
    if not len(names) == len(dtypes) == len(stypes) == len(ndims) == len(sizes):
        raise ValueError("bundle layout: 'names', 'dtypes', 'stypes', 'ndims' and 'sizes' differ in length")
    if len(set(names)) != len(names):
        raise ValueError("bundle layout: an array name appears twice")
    if sum(ndims) != len(dims):
        raise ValueError(f"bundle layout: 'ndims' add up to {sum(ndims)} but 'dims' has {len(dims)} entries")
    data = bytes(bundle.data)
    if sum(sizes) != len(data):
        raise ValueError(f"bundle layout: 'sizes' add up to {sum(sizes)} bytes but the bundle has {len(data)}")
    out: dict[str, Array] = {}
    offset = dim = 0
    for name, dtype, stype, ndim, size in zip(names, dtypes, stypes, ndims, sizes, strict=True):
        shape = tuple(dims[dim : dim + ndim])
        out[name] = Array(dtype=dtype, shape=shape, stype=stype, data=data[offset : offset + size])
        offset, dim = offset + size, dim + ndim
    return out


def pop_bundle(content: RecordDict, arrays_key: str) -> bool:
    """Replace a bundled ``content[arrays_key]`` by the arrays it carries (in place); whether it was bundled.

    ``ValueError`` (naming the problem) if the :data:`BUNDLE` record or the bundle is malformed.
    """
    if BUNDLE not in content:
        return False
    layout = content[BUNDLE]
    del content[BUNDLE]
    if not isinstance(layout, ConfigRecord):
        raise ValueError(f"record {BUNDLE!r}: expected a ConfigRecord, got {type(layout).__name__}")
    arrays = content.get(arrays_key)
    if not isinstance(arrays, ArrayRecord) or set(arrays.keys()) != {BUNDLE_ARRAY}:
        raise ValueError(f"record {BUNDLE!r} given but {arrays_key!r} does not hold exactly the array {BUNDLE_ARRAY!r}")
    content[arrays_key] = ArrayRecord(unbundle_arrays(arrays[BUNDLE_ARRAY], layout))
    return True

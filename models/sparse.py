r"""Sparse payload codec: surviving weights plus a compact mask, reconstructed exactly.

pFedKnow (seed 002, Section 3.2) uploads only what survives pruning.  Per tensor ``w`` of
``n`` elements with a boolean mask ``m`` keeping ``k`` of them, the payload is the ``k``
surviving values (``float32``, in row-major order) plus the mask in whichever code is
smaller:

* ``bitmask`` -- ``ceil(n / 8)`` bytes, ``np.packbits(m)`` (big bit order, padding bits 0);
* ``index`` -- the ``k`` flat positions of the kept elements, strictly increasing, in the
  narrowest unsigned type that holds ``n - 1`` (``uint8`` / ``uint16`` / ``uint32``):
  ``k * itemsize`` bytes;
* ``dense`` -- a tensor that keeps every element is sent as its ``n`` values alone (no mask).

Ties between ``bitmask`` and ``index`` go to ``bitmask``.  Decoding
``w_hat = scatter(values, m)`` (zeros where ``m`` is false) gives ``w * m`` bit for bit.

A payload is a flat mapping ``"<name>@<part>" -> ndarray`` with parts ``dense``, or
``values`` plus one of ``bitmask`` / ``index``; on the wire it is packed into three arrays
(:func:`pack_parts`: a per-tensor header, all values, all mask codes), so the per-array
container overhead of an ``ArrayRecord`` (~130 bytes each) does not grow with the tensors.
:func:`decode_payload` checks everything against the expected shapes before returning
anything: unknown or missing tensors, wrong dtypes or ranks, a bitmask of the wrong length
or with padding bits set, a mask/value count mismatch, indices out of range, unsorted or
repeated, and non-finite values all raise :class:`SparsePayloadError` with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

SEP = "@"
ENCODINGS = ("dense", "bitmask", "index")
_PARTS = ("dense", "values", "bitmask", "index")
_INDEX_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))


class SparsePayloadError(ValueError):
    """A sparse payload is malformed; ``str(exc)`` says why."""


def index_dtype(n: int) -> np.dtype:
    """Narrowest unsigned dtype holding every flat index ``0 .. n - 1`` of an ``n``-element tensor."""
    if n < 1:
        raise ValueError(f"a tensor needs at least one element, got {n}")
    for dt in _INDEX_DTYPES:
        if n - 1 <= np.iinfo(dt).max:
            return dt
    raise ValueError(f"{n} elements exceed uint32 indices")


def mask_code_bytes(n: int, k: int) -> dict[str, int]:
    """Bytes of the mask of ``k`` kept out of ``n`` in each code: ``bitmask`` and ``index``.

    ``bitmask = ceil(n / 8)``, ``index = k * itemsize(index_dtype(n))``.
    """
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    return {"bitmask": math.ceil(n / 8), "index": k * index_dtype(n).itemsize}


def choose_encoding(n: int, k: int) -> str:
    """``dense`` when ``k == n``, else the smaller mask code (``bitmask`` on a tie)."""
    if k == n:
        return "dense"
    sizes = mask_code_bytes(n, k)
    return "index" if sizes["index"] < sizes["bitmask"] else "bitmask"


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor's payload: ``encoding`` and its arrays (``values`` and the mask code)."""

    encoding: str
    values: np.ndarray
    code: np.ndarray | None

    @property
    def nbytes(self) -> int:
        """Raw payload bytes: values plus mask code (no container overhead)."""
        return int(self.values.nbytes) + (0 if self.code is None else int(self.code.nbytes))


def encode_tensor(values: np.ndarray | Tensor, mask: np.ndarray | Tensor) -> EncodedTensor:
    """Encode the elements of ``values`` where ``mask`` is true (see the module docstring)."""
    w = values.detach().cpu().numpy() if isinstance(values, Tensor) else np.asarray(values)
    m = mask.detach().cpu().numpy() if isinstance(mask, Tensor) else np.asarray(mask)
    if w.shape != m.shape:
        raise ValueError(f"values {w.shape} and mask {m.shape} differ in shape")
    flat_w = np.ascontiguousarray(w, dtype=np.float32).reshape(-1)
    flat_m = m.astype(bool).reshape(-1)
    n, k = flat_w.size, int(flat_m.sum())
    enc = choose_encoding(n, k)
    if enc == "dense":
        return EncodedTensor("dense", flat_w.copy(), None)
    kept = flat_w[flat_m].copy()
    if enc == "bitmask":
        return EncodedTensor("bitmask", kept, np.packbits(flat_m))
    return EncodedTensor("index", kept, np.flatnonzero(flat_m).astype(index_dtype(n)))


def encode_payload(params: Mapping[str, Tensor], masks: Mapping[str, Tensor]) -> dict[str, np.ndarray]:
    """Flat payload ``{"<name>@<part>": ndarray}`` of every tensor in ``params``.

    A tensor without a mask is sent dense.
    """
    out: dict[str, np.ndarray] = {}
    for name, t in params.items():
        if SEP in name:
            raise ValueError(f"tensor name {name!r} contains {SEP!r}")
        m = masks.get(name)
        enc = encode_tensor(t, m if m is not None else torch.ones_like(t, dtype=torch.bool))
        if enc.encoding == "dense":
            out[f"{name}{SEP}dense"] = enc.values
        else:
            out[f"{name}{SEP}values"] = enc.values
            if enc.code is None:
                raise SparsePayloadError(f"tensor {name!r}: {enc.encoding!r} encoding without its index code")
            out[f"{name}{SEP}{enc.encoding}"] = enc.code
    return out


def payload_nbytes(payload: Mapping[str, np.ndarray]) -> int:
    """Raw bytes of a payload's arrays (values and mask codes, no container overhead)."""
    return sum(int(a.nbytes) for a in payload.values())


def _vector(arr: np.ndarray, what: str, dtypes: tuple[np.dtype, ...]) -> np.ndarray:
    if arr.ndim != 1:
        raise SparsePayloadError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype not in dtypes:
        raise SparsePayloadError(f"{what} has dtype {arr.dtype}, expected one of {[str(d) for d in dtypes]}")
    return arr


def decode_tensor(name: str, shape: tuple[int, ...], parts: Mapping[str, np.ndarray]) -> tuple[Tensor, Tensor]:
    """``(dense float32 tensor, bool mask)`` of one tensor's parts; raise :class:`SparsePayloadError`."""
    n = math.prod(shape)
    f32 = (np.dtype(np.float32),)
    kinds = set(parts)
    if kinds == {"dense"}:
        values = _vector(parts["dense"], f"{name}: dense values", f32)
        if values.size != n:
            raise SparsePayloadError(f"{name}: {values.size} dense values for shape {shape} ({n} elements)")
        mask = np.ones(n, dtype=bool)
    elif kinds == {"values", "bitmask"}:
        values = _vector(parts["values"], f"{name}: values", f32)
        bits = _vector(parts["bitmask"], f"{name}: bitmask", (np.dtype(np.uint8),))
        if bits.size != math.ceil(n / 8):
            raise SparsePayloadError(f"{name}: bitmask of {bits.size} bytes, expected {math.ceil(n / 8)}")
        unpacked = np.unpackbits(bits)
        if unpacked[n:].any():
            raise SparsePayloadError(f"{name}: bitmask has padding bits set beyond {n} elements")
        mask = unpacked[:n].astype(bool)
        if int(mask.sum()) != values.size:
            raise SparsePayloadError(f"{name}: mask keeps {int(mask.sum())} elements but {values.size} values came")
    elif kinds == {"values", "index"}:
        values = _vector(parts["values"], f"{name}: values", f32)
        idx = _vector(parts["index"], f"{name}: index", _INDEX_DTYPES)
        if idx.size != values.size:
            raise SparsePayloadError(f"{name}: {idx.size} indices but {values.size} values")
        wide = idx.astype(np.int64)
        if wide.size and (wide[0] < 0 or wide[-1] >= n):
            raise SparsePayloadError(f"{name}: indices out of range 0..{n - 1}")
        if wide.size > 1 and not bool(np.all(np.diff(wide) > 0)):
            raise SparsePayloadError(f"{name}: indices are not strictly increasing")
        mask = np.zeros(n, dtype=bool)
        mask[wide] = True
    else:
        raise SparsePayloadError(f"{name}: parts {sorted(kinds)} are not one of dense | values+bitmask | values+index")
    if not bool(np.isfinite(values).all()):
        raise SparsePayloadError(f"{name}: values contain NaN or Inf")
    dense = np.zeros(n, dtype=np.float32)
    dense[mask] = values
    return torch.from_numpy(dense.reshape(shape)), torch.from_numpy(mask.reshape(shape))


def decode_payload(
    payload: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Reconstruct ``(params, masks)`` for exactly the tensors of ``shapes``.

    Raises
    ------
    SparsePayloadError
        On any malformed entry (see the module docstring); nothing is returned then.

    """
    grouped: dict[str, dict[str, np.ndarray]] = {}
    for key, arr in payload.items():
        name, sep, part = key.rpartition(SEP)
        if not sep or part not in _PARTS:
            raise SparsePayloadError(f"payload key {key!r} is not '<tensor>@<part>' with a part in {_PARTS}")
        if name not in shapes:
            raise SparsePayloadError(f"payload holds unexpected tensor {name!r}")
        grouped.setdefault(name, {})[part] = np.asarray(arr)
    missing = sorted(set(shapes) - set(grouped))
    if missing:
        raise SparsePayloadError(f"payload lacks tensors {missing[:3]}")
    params: dict[str, Tensor] = {}
    masks: dict[str, Tensor] = {}
    for name, shape in shapes.items():
        params[name], masks[name] = decode_tensor(name, tuple(shape), grouped[name])
    return params, masks


# --- wire format --------------------------------------------------------------------------------

#: Keys of the packed wire payload (one ``ArrayRecord`` of three arrays, whatever the model size).
WIRE_KEYS = ("sparse@header", "sparse@values", "sparse@codes")
_ENCODING_IDS = {"dense": 0, "bitmask": 1, "index": 2}


def pack_parts(payload: Mapping[str, np.ndarray], names: Sequence[str]) -> dict[str, np.ndarray]:
    r"""Pack a per-tensor payload into three arrays, so container overhead does not grow with the tensors.

    For the tensors ``names`` (in that order; both sides use the sorted layout names):

    * ``sparse@header`` -- ``uint32`` ``(3 T,)``: per tensor ``(encoding, values, code bytes)``
      with encoding 0 = dense, 1 = bitmask, 2 = index;
    * ``sparse@values`` -- every tensor's values (``float32``), concatenated;
    * ``sparse@codes`` -- every tensor's mask code as little-endian bytes (``uint8``), concatenated.

    The tensor names themselves are not sent.  Missing parts of a tensor are packed as empty
    (and rejected by :func:`decode_payload` after :func:`unpack_parts`).
    """
    header: list[int] = []
    values: list[np.ndarray] = []
    codes: list[np.ndarray] = []
    for name in names:
        parts = {key.rpartition(SEP)[2]: arr for key, arr in payload.items() if key.rpartition(SEP)[0] == name}
        if "dense" in parts:
            enc, vals, code = "dense", parts["dense"], np.zeros(0, np.uint8)
        else:
            enc = "index" if "index" in parts else "bitmask"
            vals = parts.get("values", np.zeros(0, np.float32))
            raw = parts.get(enc, np.zeros(0, np.uint8))
            code = np.ascontiguousarray(raw.astype(raw.dtype.newbyteorder("<"))).view(np.uint8).reshape(-1)
        header += [_ENCODING_IDS[enc], int(vals.size), int(code.size)]
        values.append(np.asarray(vals).reshape(-1))
        codes.append(code)
    return {
        "sparse@header": np.asarray(header, dtype=np.uint32),
        "sparse@values": np.concatenate(values) if values else np.zeros(0, np.float32),
        "sparse@codes": np.concatenate(codes) if codes else np.zeros(0, np.uint8),
    }


def unpack_parts(arrays: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Inverse of :func:`pack_parts` for the tensors of ``shapes`` (sorted names); validates the framing.

    Raises
    ------
    SparsePayloadError
        Wrong keys or dtypes, a header that is not one row per expected tensor, an unknown
        encoding, counts that do not add up to the arrays' lengths, or an index code whose byte
        length is not a multiple of the index type's size.

    """
    if set(arrays) != set(WIRE_KEYS):
        raise SparsePayloadError(f"wire payload keys {sorted(arrays)[:4]} are not {list(WIRE_KEYS)}")
    header = _vector(np.asarray(arrays["sparse@header"]), "header", (np.dtype(np.uint32),))
    values = _vector(np.asarray(arrays["sparse@values"]), "values", (np.dtype(np.float32),))
    codes = _vector(np.asarray(arrays["sparse@codes"]), "codes", (np.dtype(np.uint8),))
    names = sorted(shapes)
    if header.size != 3 * len(names):
        raise SparsePayloadError(f"header describes {header.size / 3:g} tensors, expected {len(names)}")
    rows = header.astype(np.int64).reshape(-1, 3)
    if int(rows[:, 1].sum()) != values.size or int(rows[:, 2].sum()) != codes.size:
        raise SparsePayloadError(
            f"header counts ({int(rows[:, 1].sum())} values, {int(rows[:, 2].sum())} code bytes) do not match "
            f"the arrays ({values.size}, {codes.size})"
        )
    out: dict[str, np.ndarray] = {}
    v0 = c0 = 0
    for name, (enc, nv, nc) in zip(names, rows.tolist(), strict=True):
        vals, code = values[v0 : v0 + nv], codes[c0 : c0 + nc]
        v0, c0 = v0 + nv, c0 + nc
        if enc == _ENCODING_IDS["dense"]:
            if nc:
                raise SparsePayloadError(f"{name}: a dense tensor carries {nc} code bytes")
            out[f"{name}{SEP}dense"] = vals
        elif enc == _ENCODING_IDS["bitmask"]:
            out[f"{name}{SEP}values"] = vals
            out[f"{name}{SEP}bitmask"] = code
        elif enc == _ENCODING_IDS["index"]:
            dt = index_dtype(math.prod(shapes[name]))
            if nc % dt.itemsize:
                raise SparsePayloadError(f"{name}: {nc} index bytes are not a multiple of {dt.itemsize}")
            out[f"{name}{SEP}values"] = vals
            out[f"{name}{SEP}index"] = code.view(dt.newbyteorder("<")).astype(dt)
        else:
            raise SparsePayloadError(f"{name}: unknown encoding {enc}")
    return out


def to_wire(params: Mapping[str, Tensor], masks: Mapping[str, Tensor]) -> dict[str, np.ndarray]:
    """The packed wire payload of ``params`` under ``masks`` (:func:`encode_payload` + :func:`pack_parts`)."""
    return pack_parts(encode_payload(params, masks), sorted(params))


def from_wire(
    arrays: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``(params, masks)`` of a packed wire payload; raise :class:`SparsePayloadError` when malformed."""
    return decode_payload(unpack_parts(arrays, shapes), shapes)

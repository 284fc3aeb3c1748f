"""A GGUF file's header, walked once: its metadata, and where each tensor lies in a map of the file.

``gguf.GGUFReader`` wraps every element of every metadata array in numpy views: for SmolLM2's
49k-token vocabulary and 49k merges, ~500k Python objects (~130 MB) that a model's weights never
need. Freed after loading, they still left ~15 MB resident in a server: the model's own modules
and tensors, made while they lived, pinned Python's memory arenas they shared. Here an array
whose key starts with one of ``skip_arrays`` is only measured (its length is kept), and the
tokenizer reads its own arrays when it builds itself.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import attrs
import gguf
import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Tensor types numpy reads as values (GGUFReader's choice); every other type as rows of raw bytes.
_VALUE_TYPES = {
    gguf.GGMLQuantizationType.F16: np.float16, gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


@attrs.frozen(eq=False)
class TensorInfo:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the innermost (row) dimension first
    data: np.ndarray  # a view of the map: [..., row bytes] for block types, else [..., row] of values


@attrs.frozen(eq=False)
class GGUFHeader:
    metadata: dict[str, Any]  # key -> str, int, float, bool or list (arrays not skipped)
    array_lengths: dict[str, int]  # key -> length, for every array (skipped or not)
    tensors: list[TensorInfo]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def read_metadata(buf, skip_arrays: tuple[str, ...] = ()) -> tuple[dict[str, Any], dict[str, int], int, int]:
    """The key/value section of a GGUF file's bytes ``buf``: ``(metadata, array_lengths, tensor count,
    offset of the tensor infos)``. Raises ``ValueError`` (or ``struct.error``) on a damaged header."""
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"not a GGUF file (magic {bytes(buf[:4])!r})")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2 or version > 0xFFFF:  # a big-endian file reads as a huge version
        raise ValueError(f"GGUF version {version} is not supported (little-endian, version 2 or later)")
    pos, meta, lengths = 24, {}, {}
    for _ in range(n_kv):
        key, pos = _read_string(buf, pos)
        (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
        if vtype == _ARRAY:
            etype, n = struct.unpack_from("<IQ", buf, pos)
            lengths[key] = n
            if key.startswith(skip_arrays):
                pos = _skip_array(buf, pos + 12, etype, n)
                continue
        meta[key], pos = _read_value(buf, pos, vtype)
    return meta, lengths, n_tensors, pos


def read_header(path: str | os.PathLike, skip_arrays: tuple[str, ...] = ("tokenizer.",)) -> GGUFHeader:
    """The metadata and tensors of the GGUF file at ``path``; the tensors' data are views of one
    read-only map of the file, read from disk only when touched. Raises ``ValueError`` (or
    ``struct.error``) on a damaged header, ``OSError`` on an unreadable file."""
    data = np.memmap(path, mode="r")
    buf = data.view(np.ndarray)  # plain-ndarray views: numpy's memmap subclass slices ~10x slower
    meta, lengths, n_tensors, pos = read_metadata(buf, skip_arrays)
    infos = []
    for _ in range(n_tensors):
        name, pos = _read_string(buf, pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, gguf.GGMLQuantizationType(qtype), tuple(dims), offset))
    alignment = int(meta.get("general.alignment", 32))
    start = -(-pos // alignment) * alignment
    tensors = []
    for name, qtype, dims, offset in infos:
        shape = tuple(reversed(dims))  # numpy order: rows outermost
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims)) * type_size // block
        if qtype in _VALUE_TYPES:
            dtype = _VALUE_TYPES[qtype]
        else:
            dtype, shape = np.uint8, (*shape[:-1], shape[-1] * type_size // block)
        lo = start + offset
        if lo + nbytes > len(buf):
            raise ValueError(f"tensor {name} runs past the end of the file")
        tensors.append(TensorInfo(name, qtype, dims, buf[lo:lo + nbytes].view(dtype).reshape(shape)))
    return GGUFHeader(meta, lengths, tensors)


def _read_string(buf, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + n
    if end > len(buf):
        raise ValueError("string runs past the end of the file")
    return bytes(buf[pos + 8:end]).decode("utf-8", errors="replace"), end


def _read_value(buf, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _read_string(buf, pos)
    if vtype != _ARRAY:
        raise ValueError(f"unknown GGUF value type {vtype}")
    etype, n = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in _SCALARS:  # numeric arrays in one read
        dtype = np.dtype(_SCALARS[etype])
        return np.frombuffer(buf, dtype=dtype, count=n, offset=pos).tolist(), pos + n * dtype.itemsize
    values = []
    for _ in range(n):
        value, pos = _read_value(buf, pos, etype)
        values.append(value)
    return values, pos


def _skip_array(buf, pos: int, etype: int, n: int) -> int:
    """The offset past an array of ``n`` values of type ``etype`` at ``pos``, none of them built."""
    if etype in _SCALARS:
        return pos + n * struct.calcsize(_SCALARS[etype])
    if etype == _STRING:
        for _ in range(n):
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        return pos
    for _ in range(n):  # arrays of arrays
        (inner,), (count,) = struct.unpack_from("<I", buf, pos), struct.unpack_from("<Q", buf, pos + 4)
        pos = _skip_array(buf, pos + 12, inner, count)
    return pos

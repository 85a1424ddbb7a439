"""Read and write .safetensors files with NumPy, bf16 included (NumPy has no bf16: we keep its raw uint16 bits).

Format: an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the data.
A file that is truncated or malformed anywhere raises ValueError naming the file, never a short or garbled tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np

_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I64": np.int64}


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bf16 bit patterns (uint16) to float32: the bf16 bits are the top half of the f32 bits."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bf16 (ties to even), returned as uint16 bit patterns."""
    bits = np.array(x, dtype=np.float32, order="C").view(np.uint32)  # one copy, rounded in place: no other
    # temporary as large as the array
    half = bits >> np.uint32(16)
    half &= np.uint32(1)  # the bit that breaks a tie to even
    half += np.uint32(0x7FFF)
    bits += half
    bits >>= np.uint32(16)
    out = bits.astype(np.uint16)
    out[np.isnan(x)] = 0x7FC0
    return out


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Return {name: array} (memory-mapped, read-only). BF16 tensors are widened to float32, F16 too."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: not a safetensors file (too short: {size} bytes, truncated?)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"{path}: not a safetensors file (header length {n} exceeds file size {size}, "
                             "truncated?)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (start, end) = info["dtype"], [_index(d) for d in info["shape"]], info["data_offsets"]
            start, end = _index(start), _index(end)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: corrupt safetensors header entry for tensor {name}: {info!r}") from None
        if start > end:
            raise ValueError(f"{path}: tensor {name} has data_offsets {[start, end]} that run backwards")
        dtype = _NUMPY_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {dtype_name!r}")
        if end > len(data):
            raise ValueError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        if end - start != math.prod(shape) * np.dtype(dtype).itemsize:  # (math.prod: no int64 overflow)
            raise ValueError(f"{path}: tensor {name}: shape {shape} does not match its {end - start} bytes")
        arr = data[start:end].view(dtype).reshape(shape)
        if dtype_name == "BF16":
            arr = bf16_to_f32(arr)
        elif dtype_name == "F16":
            arr = arr.astype(np.float32)
        out[name] = arr
    return out


def _index(x) -> int:
    """x as a count or offset: an int >= 0 (a float, bool, string or negative number is a corrupt header)."""
    if type(x) is not int or x < 0:
        raise ValueError(x)
    return x


def write_safetensors(path: str, tensors: dict[str, np.ndarray], bf16: bool = False) -> None:
    """Write float32 tensors; with bf16=True they are rounded to bf16 and stored as BF16.

    The file is written to a temporary name and renamed, so an interrupted write never leaves a half file.
    """
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        arr = np.asarray(arr, dtype=np.float32)
        arr = arr if arr.flags.c_contiguous else arr.copy()  # (np.ascontiguousarray would make 0-d arrays 1-d)
        blob = f32_to_bf16(arr) if bf16 else arr
        nbytes = blob.nbytes
        header[name] = {"dtype": "BF16" if bf16 else "F32", "shape": list(arr.shape),
                        "data_offsets": [offset, offset + nbytes]}
        blobs.append(blob)
        offset += nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    tmp = f"{path}.part-{os.getpid()}"  # one per process: a concurrent writer never shares this file
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for blob in blobs:
            f.write(blob.tobytes())
    os.replace(tmp, path)

"""Raw safetensors I/O: header parsing with validation, and a streaming shard writer.

Why not only the safetensors library: kq must copy kept tensors *byte for byte* and
write output shards without holding a whole shard in memory. The format is simple
(8-byte little-endian header length, JSON header, one flat data buffer), so kq reads
headers itself to validate shards up front (a truncated download is caught before
any work), copies kept tensors straight from file ranges, and writes each output
shard tensor by tensor while hashing it. Reading tensors as torch tensors still goes
through safetensors' own mmap reader (see reader.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from kq.errors import KqError

DTYPE_SIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
TORCH_DTYPE = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "I16": torch.int16, "F16": torch.float16, "BF16": torch.bfloat16,
    "I32": torch.int32, "F32": torch.float32, "I64": torch.int64, "F64": torch.float64,
}
DTYPE_NAME = {v: k for k, v in TORCH_DTYPE.items()}
MAX_HEADER = 100 * 1024 * 1024  # the library's own limit


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    end: int    # absolute file offset past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int


def nbytes_of(dtype: str, shape) -> int:
    n = DTYPE_SIZE[dtype]
    for d in shape:
        n *= int(d)
    return n


def read_header(path: str | Path) -> ShardHeader:
    """Parse and validate a shard's header; raise KqError naming the file if it is
    corrupted or shorter than its header says (an interrupted download)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise KqError(f"{path.name}: truncated safetensors file ({size} bytes); delete it and download it again")
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > MAX_HEADER or 8 + hlen > size:
                raise KqError(f"{path.name}: corrupted or truncated safetensors header; delete it and download it again")
            header = json.loads(f.read(hlen))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KqError(f"{path.name}: corrupted safetensors header ({e.__class__.__name__}); delete it and download it again") from None
    except OSError as e:
        raise KqError(f"{path}: cannot read ({e.strerror})") from None
    if not isinstance(header, dict):
        raise KqError(f"{path.name}: corrupted safetensors header")
    data_start = 8 + hlen
    metadata = header.pop("__metadata__", None) or {}
    tensors: dict[str, TensorEntry] = {}
    end_max = 0
    for name, info in header.items():
        try:
            dtype, shape, (a, b) = info["dtype"], tuple(int(x) for x in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise KqError(f"{path.name}: corrupted safetensors header entry for {name!r}") from None
        if dtype not in DTYPE_SIZE or b < a or nbytes_of(dtype, shape) != b - a:
            raise KqError(f"{path.name}: corrupted safetensors header entry for {name!r}")
        tensors[name] = TensorEntry(name, dtype, shape, data_start + a, data_start + b)
        end_max = max(end_max, b)
    if data_start + end_max > size:
        raise KqError(
            f"{path.name}: truncated: header promises {data_start + end_max} bytes, file has {size}; "
            "delete it and download it again")
    return ShardHeader(path, tensors, metadata, data_start)


def read_bytes(entry: TensorEntry, path: str | Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(entry.start)
        return f.read(entry.nbytes)


class StreamingShardWriter:
    """Writes one safetensors file tensor by tensor, in the order the entries were
    declared, to `<final>.tmp`; `close()` fsyncs and renames, so a file under its
    final name is always complete. sha256 is computed on the fly."""

    def __init__(self, final_path: str | Path, entries: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.final = Path(final_path)
        self.tmp = self.final.with_name(self.final.name + ".tmp")
        self.order = [name for name, _, _ in entries]
        self.expected = {name: nbytes_of(dt, shape) for name, dt, shape in entries}
        header: dict = {}
        if metadata:
            header["__metadata__"] = metadata
        off = 0
        for name, dtype, shape in entries:
            n = nbytes_of(dtype, shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        hjson = json.dumps(header, separators=(",", ":")).encode()
        hjson += b" " * (-len(hjson) % 8)  # the library aligns the data buffer to 8 bytes
        self.sha = hashlib.sha256()
        self.size = 0
        self.f = open(self.tmp, "wb")
        self._write(struct.pack("<Q", len(hjson)) + hjson)
        self.next = 0

    def _write(self, b) -> None:
        self.f.write(b)
        self.sha.update(b)
        self.size += len(b)

    def write(self, name: str, data) -> None:
        """data: bytes/memoryview, or a CPU tensor (written in its own dtype)."""
        if self.next >= len(self.order) or self.order[self.next] != name:
            raise RuntimeError(f"tensor {name!r} written out of order")
        if isinstance(data, torch.Tensor):
            data = tensor_bytes(data)
        if len(data) != self.expected[name]:
            raise RuntimeError(f"tensor {name!r}: {len(data)} bytes, header says {self.expected[name]}")
        self._write(data)
        self.next += 1

    def copy_from(self, name: str, src_path: str | Path, entry: TensorEntry, chunk: int = 16 << 20) -> None:
        """Copy a kept tensor's bytes straight from its source file range, in chunks,
        so a multi-GB embedding never sits in memory whole."""
        if self.next >= len(self.order) or self.order[self.next] != name:
            raise RuntimeError(f"tensor {name!r} written out of order")
        if entry.nbytes != self.expected[name]:
            raise RuntimeError(f"tensor {name!r}: {entry.nbytes} bytes, header says {self.expected[name]}")
        with open(src_path, "rb") as f:
            f.seek(entry.start)
            left = entry.nbytes
            while left:
                b = f.read(min(chunk, left))
                if not b:
                    raise RuntimeError(f"{src_path}: ended early while copying {name}")
                self._write(b)
                left -= len(b)
        self.next += 1

    def close(self) -> tuple[str, int]:
        if self.next != len(self.order):
            raise RuntimeError(f"{self.final.name}: {len(self.order) - self.next} tensors never written")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.final)
        return self.sha.hexdigest(), self.size

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, without a copy where possible."""
    t = t.detach().contiguous().cpu()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")

"""Raw safetensors I/O: header parsing with validation, and a streaming shard writer.

Why not only the safetensors library: kq must copy kept tensors *byte for byte* and
write output shards without holding a whole shard in memory. The format is simple
(8-byte little-endian header length, JSON header, one flat data buffer), so kq reads
headers itself to validate shards up front (a truncated download is caught before
any work), copies kept tensors straight from file ranges, and writes each output
shard tensor by tensor while hashing it. Reading tensors as torch tensors still goes
through safetensors' own mmap reader (see reader.py).

Host cost of the writer (the quantize run is bound by it, not by the GPU): every buffer
is written with os.write from the caller's memory (no bytes() copies), hashed by a
thread of its own while it is being written (hashlib releases the GIL), kept tensors
come from an mmap of the source file (no read() copy), and the kernel is asked to
start writing each 64 MB back to disk as soon as it is written, so the fsync at close
waits for the tail only. kq.profile.PROFILE (KQ_PROFILE=1) sums per-stage wall time per thread.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import queue
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kq.errors import KqError
from kq.profile import PROFILE

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




def _load_sync_file_range():
    """libc's sync_file_range (Linux): start writeback of a file range without waiting."""
    if os.environ.get("KQ_NO_WRITEBACK"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    f.restype = ctypes.c_int
    return f


_SYNC_FILE_RANGE = _load_sync_file_range()
SYNC_FILE_RANGE_WRITE = 2
WRITEBACK_EVERY = 64 << 20


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
    final name is always complete. sha256 is computed on the fly, by a thread of its own
    that hashes each buffer while it is written (the buffer must stay unchanged until
    `close`: tensors and mmap ranges handed in are only read). Not thread-safe: one
    thread calls write/copy_from/close."""

    HASH_QUEUE = 8  # buffers written but not yet hashed (each keeps its memory alive)

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
        self._synced = 0  # bytes handed to writeback so far
        self._maps: dict[str, tuple] = {}
        self._hq: queue.Queue = queue.Queue(maxsize=self.HASH_QUEUE)
        self._herr: BaseException | None = None
        self._stop = False
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._hasher = threading.Thread(target=self._hash_loop, name="kq-sha256", daemon=True)
        self._hasher.start()
        self.next = 0
        try:
            self._write(struct.pack("<Q", len(hjson)) + hjson)
        except BaseException:
            self.abort()
            raise

    def _hash_loop(self) -> None:
        while True:
            b = self._hq.get()
            if b is None:
                return
            if self._stop or self._herr is not None:
                continue
            t = time.perf_counter()
            try:
                self.sha.update(b)
            except BaseException as e:  # noqa: BLE001 - re-raised by close()
                self._herr = e
            PROFILE.add("sha256", t, b.nbytes)

    def _write(self, b) -> None:
        mv = memoryview(b).cast("B")
        n = mv.nbytes
        if not n:
            return
        t = time.perf_counter()
        self._hq.put(mv)  # hashed by the hasher thread while this thread writes it
        PROFILE.add("wait:hash", t)
        t = time.perf_counter()
        done = 0
        while done < n:
            done += os.write(self.fd, mv[done:])
        PROFILE.add("write", t, n)
        self.size += n
        if _SYNC_FILE_RANGE is not None and self.size - self._synced >= WRITEBACK_EVERY:
            t = time.perf_counter()
            _SYNC_FILE_RANGE(self.fd, self._synced, self.size - self._synced, SYNC_FILE_RANGE_WRITE)
            PROFILE.add("writeback", t, self.size - self._synced)
            self._synced = self.size

    def write(self, name: str, data) -> None:
        """data: bytes/memoryview, or a CPU tensor (written in its own dtype)."""
        if self.next >= len(self.order) or self.order[self.next] != name:
            raise RuntimeError(f"tensor {name!r} written out of order")
        if isinstance(data, torch.Tensor):
            data = tensor_bytes(data)
        n = memoryview(data).nbytes
        if n != self.expected[name]:
            raise RuntimeError(f"tensor {name!r}: {n} bytes, header says {self.expected[name]}")
        self._write(data)
        self.next += 1

    def _map(self, src_path) -> tuple:
        key = str(src_path)
        got = self._maps.get(key)
        if got is None:
            with open(src_path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
            got = self._maps[key] = (m, size)
        return got

    def copy_from(self, name: str, src_path: str | Path, entry: TensorEntry, chunk: int = 64 << 20) -> None:
        """Copy a kept tensor's bytes straight from its source file range (an mmap of the
        source: no read() copy; written and hashed from the page cache), in chunks."""
        if self.next >= len(self.order) or self.order[self.next] != name:
            raise RuntimeError(f"tensor {name!r} written out of order")
        if entry.nbytes != self.expected[name]:
            raise RuntimeError(f"tensor {name!r}: {entry.nbytes} bytes, header says {self.expected[name]}")
        if entry.nbytes:
            m, size = self._map(src_path)
            if size < entry.end:
                raise RuntimeError(f"{src_path}: ended early while copying {name}")
            mv = memoryview(m)
            for off in range(entry.start, entry.end, chunk):
                self._write(mv[off:min(off + chunk, entry.end)])
            del mv
        self.next += 1

    def _stop_hasher(self) -> None:
        if self._hasher.is_alive():
            self._hq.put(None)
            self._hasher.join()

    def close(self) -> tuple[str, int]:
        if self.next != len(self.order):
            raise RuntimeError(f"{self.final.name}: {len(self.order) - self.next} tensors never written")
        self._hq.put(None)  # the hasher finishes the queue while this thread waits for the disk
        t = time.perf_counter()
        os.fsync(self.fd)
        PROFILE.add("fsync", t)
        t = time.perf_counter()
        self._hasher.join()
        PROFILE.add("wait:hash", t)
        os.close(self.fd)
        self.fd = -1
        self._maps.clear()
        if self._herr is not None:
            self.tmp.unlink(missing_ok=True)
            raise self._herr
        os.replace(self.tmp, self.final)
        return self.sha.hexdigest(), self.size

    def abort(self) -> None:
        self._stop = True
        self._stop_hasher()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._maps.clear()
        self.tmp.unlink(missing_ok=True)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, without a copy where possible."""
    t = t.detach().contiguous().cpu()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")

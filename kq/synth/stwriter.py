"""Streaming safetensors writer for synthetic checkpoints.

The header is computed from shapes alone, so a shard is written piece by piece at known
offsets without ever holding more than one row block (plus small cached tensors) in
memory. The bytes equal what `safetensors.torch.save_file` writes for the same tensors
(and what the real checkpoints show): `{"__metadata__":{"format":"pt"}, ...}` first,
tensors in safetensors' dtype order, largest first (so every tensor stays aligned), then
by name; header padded with spaces to a multiple of 8.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .layout import DTYPES, Entry, Layout

SMALL_CACHE_BYTES = 1 << 20
# safetensors sorts tensors by its Dtype enum, largest first, then by name; this is that
# enum's order for the dtypes written here (so the bytes match save_file's exactly).
DTYPE_ORDER = ["F8_E4M3", "F16", "BF16", "I32", "F32", "I64"]  # a tensor bound for a later shard is kept up to this size, else regenerated


def header_for(entries: list[Entry], metadata: dict | None = {"format": "pt"}) -> tuple[bytes, dict[str, int]]:  # noqa: B006 - read only
    """-> (8-byte length + padded JSON header, {name: absolute file offset of its data}).
    `metadata=None` writes no `__metadata__` (Kimi K2's published shards have none)."""
    ordered = sorted(entries, key=lambda e: (-DTYPE_ORDER.index(e.dtype), e.name))
    head: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    rel, pos = {}, 0
    for e in ordered:
        head[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        rel[e.name] = pos
        pos += e.nbytes
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {n: start + o for n, o in rel.items()}


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def _make_group(layout: Layout, fd: int, group: str, here: dict[str, int], keep: dict[str, bytearray],
                entry: dict[str, Entry]) -> dict[str, int]:
    """Generate one group; write its pieces for this shard (`here`: {name: file offset})
    with pwrite, copy pieces bound for a later shard into `keep`. -> bytes written per name."""
    written = dict.fromkeys(here, 0)
    for name, off, t in layout.pieces(group):
        e = entry[name]
        if t.dtype != DTYPES[e.dtype]:
            raise AssertionError(f"{name}: made {t.dtype}, declared {e.dtype}")
        data = as_bytes(t)
        if name in here:
            os.pwrite(fd, data, here[name] + off)
            written[name] += len(data)
        elif name in keep:
            keep[name][off : off + len(data)] = data
    return written


def write_shards(layout: Layout, assignment: dict[str, str], folder: Path, workers: int = 1) -> None:
    """Write every shard named in `assignment` ({tensor name: file name}) into folder,
    each under a temp name renamed when complete. With workers > 1, tensor groups are
    generated in parallel threads (torch releases the GIL; offsets are fixed by the
    header, so the bytes do not depend on the order in which groups finish)."""
    entry = {e.name: e for e in layout.entries}
    groups: dict[str, list[Entry]] = {}
    for e in layout.entries:
        groups.setdefault(e.group, []).append(e)
    files = list(dict.fromkeys(assignment[e.name] for e in layout.entries))  # layout order
    cache: dict[str, bytes] = {}  # small tensors made while writing an earlier shard
    pool = ThreadPoolExecutor(workers) if workers > 1 else None
    try:
        for i, fname in enumerate(files):
            later = set(files[i + 1 :])
            members = [e for e in layout.entries if assignment[e.name] == fname]
            header, offsets = header_for(members)
            written = dict.fromkeys((e.name for e in members), 0)
            tmp = folder / f".{fname}.tmp-{os.getpid()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.pwrite(fd, header, 0)
                jobs = []
                for group in dict.fromkeys(e.group for e in members):
                    here = {e.name: offsets[e.name] for e in groups[group] if assignment[e.name] == fname}
                    for name in list(here):
                        if name in cache:
                            os.pwrite(fd, cache.pop(name), here.pop(name))
                            written[name] = entry[name].nbytes
                    if not here:
                        continue
                    keep = {e.name: bytearray(e.nbytes) for e in groups[group]
                            if assignment[e.name] in later and e.nbytes <= SMALL_CACHE_BYTES and e.name not in cache}
                    args = (layout, fd, group, here, keep, entry)
                    jobs.append((keep, pool.submit(_make_group, *args) if pool else _make_group(*args)))
                for keep, job in jobs:
                    written.update(job.result() if pool else job)
                    cache.update((n, bytes(b)) for n, b in keep.items())
            finally:
                os.close(fd)
            short = [n for n, w in written.items() if w != entry[n].nbytes]
            if short:
                raise AssertionError(f"{fname}: wrong byte count for {short[:3]}")
            os.replace(tmp, folder / fname)
    finally:
        if pool:
            pool.shutdown()

"""Streaming safetensors writer for synthetic checkpoints.

The header is computed from shapes alone, so a shard is written tensor group by tensor
group at known offsets without ever holding more than one group (plus small cached
scales) in memory. File layout matches what `safetensors.torch.save_file` produces
and what the real checkpoints show: `{"__metadata__":{"format":"pt"}, ...}` first,
tensors ordered by dtype size (largest first, so every tensor stays aligned) then
name, header padded with spaces to a multiple of 8.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from .layout import DTYPES, Entry, Layout

SMALL_CACHE_BYTES = 1 << 20  # tensors up to this size are kept for a later shard; bigger are regenerated


def header_for(entries: list[Entry]) -> tuple[bytes, dict[str, int]]:
    """-> (8-byte length + padded JSON header, {name: absolute file offset of its data})."""
    ordered = sorted(entries, key=lambda e: (-DTYPES[e.dtype].itemsize, e.name))
    head: dict[str, object] = {"__metadata__": {"format": "pt"}}
    rel, pos = {}, 0
    for e in ordered:
        head[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        rel[e.name] = pos
        pos += e.nbytes
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {n: start + o for n, o in rel.items()}


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_shards(layout: Layout, assignment: dict[str, str], folder: Path) -> None:
    """Write every shard named in `assignment` ({tensor name: file name}) into folder.

    Each shard goes to a temp name and is renamed when complete. Within a shard each
    tensor group is produced once and its members written at their header offsets.
    """
    group_entries: dict[str, list[Entry]] = {}
    for e in layout.entries:
        group_entries.setdefault(e.group, []).append(e)
    files = list(dict.fromkeys(assignment[e.name] for e in layout.entries))  # layout order
    cache: dict[str, torch.Tensor] = {}
    for i, fname in enumerate(files):
        pending = set(files[i + 1 :])
        members = [e for e in layout.entries if assignment[e.name] == fname]
        header, offsets = header_for(members)
        tmp = folder / f".{fname}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(header)
            for group in dict.fromkeys(e.group for e in members):
                made = None
                for e in group_entries[group]:
                    where = assignment[e.name]
                    if where != fname and (where not in pending or e.name in cache):
                        continue
                    t = cache.pop(e.name, None)
                    if t is None:
                        made = made if made is not None else layout.produce(group)
                        t = made[e.name]
                    if where != fname:
                        if e.nbytes <= SMALL_CACHE_BYTES:
                            cache[e.name] = t  # e.g. a scale that lives in a later shard
                        continue  # a big one is regenerated there (same seed, same bytes)
                    if t.dtype != DTYPES[e.dtype] or tuple(t.shape) != e.shape:
                        raise AssertionError(f"{e.name}: made {t.dtype} {tuple(t.shape)}, declared {e.dtype} {e.shape}")
                    f.seek(offsets[e.name])
                    f.write(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))
                del made
        os.replace(tmp, folder / fname)

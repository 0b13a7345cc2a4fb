"""Turn a Layout plus side files into a checkpoint folder: shard assignment, shard file
names, the index, JSON files, and the atomic appearance of the whole folder."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch

from .layout import Layout
from .stwriter import write_shards


def shard_name(i: int, n: int, style: str) -> str:
    """1-based. 'padded': model-00001-of-00003 (GLM); 'unpadded': model-1-of-3 (Kimi K2)."""
    if style == "padded":
        return f"model-{i:05d}-of-{n:05d}.safetensors"
    if style == "unpadded":
        return f"model-{i}-of-{n}.safetensors"
    raise ValueError(f"shard_names must be 'padded' or 'unpadded', got {style!r}")


def assign(layout: Layout, n_shards: int | None, max_shard_bytes: int | None, style: str) -> dict[str, str]:
    """Cut the layout, in order, into shards of about equal bytes; a tensor group (a
    weight and its scale) stays together. max_shard_bytes, when given, sets the count."""
    groups: dict[str, int] = {}
    for e in layout.entries:
        groups[e.group] = groups.get(e.group, 0) + e.nbytes
    total = sum(groups.values())
    if max_shard_bytes:
        n_shards = max(1, math.ceil(total / max_shard_bytes))
    n = n_shards or 1
    if n > len(groups):
        raise ValueError(f"n_shards={n} but only {len(groups)} tensor groups")
    where, done = {}, 0
    for g, size in groups.items():
        # the group's midpoint decides its shard, so cuts fall near k*total/n
        where[g] = min(n - 1, int((done + size / 2) * n / total)) if total else 0
        done += size
    # very uneven groups can leave a shard empty: fall back to cutting by group count
    if len(set(where.values())) != n:
        names = list(groups)
        where = {g: i * n // len(names) for i, g in enumerate(names)}
    return {e.name: shard_name(where[e.group] + 1, n, style) for e in layout.entries}


def split_scales(layout: Layout, assignment: dict[str, str]) -> list[str]:
    """Odd case: move the scale of every other FP8 Linear to the next shard (wrapping), as
    real checkpoints sometimes have it. Returns the moved scale names."""
    files = sorted(set(assignment.values()), key=lambda f: list(assignment.values()).index(f))
    if len(files) < 2:
        raise ValueError("split_scale needs n_shards >= 2")
    scales = [e.name for e in layout.entries if e.name.endswith((".weight_scale_inv", ".weight_scale"))]
    moved = scales[::2]
    for s in moved:
        assignment[s] = files[(files.index(assignment[s]) + 1) % len(files)]
    return moved


def dump_json(obj) -> str:
    return json.dumps(obj, indent=2)


def write_folder(
    out_dir: Path,
    layout: Layout,
    assignment: dict[str, str],
    files: dict[str, str | bytes],
    *,
    index: bool = True,
    overwrite: bool = False,
    threads: int | None = None,
    workers: int | None = None,
) -> Path:
    """Write everything into a temp sibling folder, then rename it to out_dir: a reader
    never sees a half-written checkpoint. An existing empty out_dir (e.g. pytest's
    tmp_path) is replaced; a non-empty one only with overwrite=True."""
    out_dir = Path(out_dir).absolute()
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} is not empty (pass overwrite=True to replace it)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.synth-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # torch intra-op threads: 1 unless `threads` says otherwise. Under load, torch's
    # thread pool costs milliseconds per op on a 2-core box (measured 7.5 ms vs 0.05 ms
    # for a 256x256 op; 5x slower on full-size row blocks at load 8). Tiny checkpoints use
    # one thread. Full-size ones generate tensor groups in parallel worker threads
    # (default: one per core, up to 16), each op single-threaded: that scales better
    # than torch's intra-op threads on 128-row blocks.
    big = max((e.nbytes for e in layout.entries), default=0) >= 4 << 20
    if workers is None:
        workers = min(16, os.cpu_count() or 1) if big else 1
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads or 1)
        write_shards(layout, assignment, tmp, workers=workers)
        if index:
            weight_map = dict(sorted(assignment.items()))
            total = sum(e.nbytes for e in layout.entries)
            files = dict(files, **{"model.safetensors.index.json": dump_json(
                {"metadata": {"total_size": total}, "weight_map": weight_map})})
        for name, data in sorted(files.items()):
            (tmp / name).write_bytes(data.encode() if isinstance(data, str) else data)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        torch.set_num_threads(before)
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir

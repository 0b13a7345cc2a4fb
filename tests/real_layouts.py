"""Full-size replicas of real checkpoints from ../shared/layouts, for tests (never inside the repo).

`write_replica` writes every shard of a published checkpoint with its real header (names, dtypes,
shapes, data offsets; the safetensors writer's ordering, see kq.synth.real_layouts) and a data
section that is a sparse hole: a 756 GB checkpoint costs a few MB of disk, and every check that
reads headers or file sizes sees the real thing. `fill_random` then writes random bytes into the
data ranges of the tensors a test converts for real (FP8 codes without NaN patterns, positive F32
scales), so only those cost disk.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from functools import cache
from pathlib import Path

import torch

from kq.synth.real_layouts import Layout, read_layout, shard_entries, shard_header
from kq_testutil import SHARED

LAYOUTS = SHARED / "layouts"
GLM = "zai-org_GLM-5.2-FP8"
KIMI = "moonshotai_Kimi-K2-Instruct"
CHUNK = 32 << 20
MODELS = {GLM: dict(alias="glm-5.2", tensors=118_629, group=128, experts=256, inter=2048, layers=78),
          KIMI: dict(alias="kimi-k2", tensors=139_644, group=32, experts=384, inter=2048, layers=61)}


def is_expert(name: str) -> bool:
    """model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight, spelled out apart from kq's own regex."""
    p = name.split(".")
    return (len(p) == 8 and p[:2] == ["model", "layers"] and p[3:5] == ["mlp", "experts"] and p[5].isdigit()
            and p[6] in ("gate_proj", "up_proj", "down_proj") and p[7] == "weight")


@cache
def layout(folder: str) -> Layout:
    return read_layout(LAYOUTS / folder)


def write_replica(lay: Layout, out: Path, *, shards=None, keep=None) -> Path:
    """Sparse header-exact shards (all, or `shards`), the published config.json, and an index of the
    tensors `keep(name)` accepts among those shards (default: all of them)."""
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard, entries in sorted(shard_entries(lay).items()):
        if shards is not None and shard not in shards:
            continue
        head, _ = shard_header(entries)
        with open(out / shard, "wb") as f:
            f.write(head)
            f.truncate(len(head) + sum(e.nbytes for e in entries))  # a hole: no data blocks
        weight_map.update({e.name: shard for e in entries if keep is None or keep(e.name)})
    total = sum(math.prod(lay.tensors[n][1]) * _itemsize(lay.tensors[n][0]) for n in weight_map)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    shutil.copyfile(LAYOUTS / _folder_of(lay) / "config.json", out / "config.json")
    return out


def _folder_of(lay: Layout) -> str:
    return lay.repo_id.replace("/", "_", 1)


def _itemsize(dtype: str) -> int:
    return {"F8_E4M3": 1, "BF16": 2, "F32": 4}[dtype]


def fill_random(folder: Path, lay: Layout, names, *, seed: int = 0, skip_bf16_over: int = 64 << 20) -> int:
    """Random data for `names` at their real offsets; returns the bytes written. BF16 tensors over
    `skip_bf16_over` bytes (embeddings, lm_head) stay holes: kq copies them byte for byte either way."""
    by_shard: dict[str, list[str]] = {}
    for n in names:
        by_shard.setdefault(lay.tensors[n][2], []).append(n)
    g = torch.Generator().manual_seed(seed)
    written = 0
    for shard, members in sorted(by_shard.items()):
        _, offsets = shard_header(shard_entries(lay)[shard])
        fd = os.open(folder / shard, os.O_WRONLY)
        try:
            for n in sorted(members):
                dt, shape, _ = lay.tensors[n]
                nbytes = math.prod(shape) * _itemsize(dt)
                if dt == "BF16" and nbytes > skip_bf16_over:
                    continue
                for off in range(0, nbytes, CHUNK):
                    b = _random_bytes(dt, min(CHUNK, nbytes - off), g)
                    os.pwrite(fd, b, offsets[n] + off)
                    written += len(b)
        finally:
            os.close(fd)
    return written


def _random_bytes(dtype: str, nbytes: int, g: torch.Generator) -> bytes:
    if dtype == "F8_E4M3":
        # Bit 6 (the exponent's top bit) cleared: |x| <= 1.875 and never the NaN pattern S.1111.111.
        t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g) & 0xBF
    elif dtype == "F32":
        t = (torch.rand(nbytes // 4, generator=g) * 1e-3 + 1e-4).view(torch.uint8)  # positive, like block scales
    else:
        t = (torch.randn(nbytes // 2, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8)
    return t.numpy().tobytes()


# ---- the slices converted for real -------------------------------------------------------------

def _expert_id(name):
    return int(name.split(".")[5]) if is_expert(name.removesuffix("_scale_inv")) else None


def _whole_experts_in(lay, shard, layer):
    """Expert ids of `layer` whose three projections (and scales) all sit in `shard`."""
    where: dict[int, set] = {}
    for n, (_, _, s) in lay.tensors.items():
        if n.startswith(f"model.layers.{layer}.mlp.experts.") and _expert_id(n) is not None:
            where.setdefault(_expert_id(n), set()).add(s)
    return sorted(e for e, s in where.items() if s == {shard})


def slice_spec(model):
    """(whole shards, restricted shards: {shard: keep(name)}) of the slice a test converts.
    GLM-5.2: shard 1 whole (lm_head, embeddings, dense layers 0 and 1 with their DSA indexers and
    partial 128-blocks, 60 experts of layer 10); the MTP layer 78's tensors in shards 136 and 138
    (eh_proj, norms, attention, indexer, router, shared expert, shared_head) with one whole expert
    from each, since all of 136-138 is 5 GB of experts. Kimi K2: shard 1 whole (embeddings, dense
    layer 0, rotary_emb.inv_freq, partial blocks), and layer 1's shard 2 with two of its 384 experts."""
    lay = layout(model)
    if model == GLM:
        whole = {"model-00001-of-00141.safetensors"}
        part = {}
        for s in ("model-00136-of-00141.safetensors", "model-00138-of-00141.safetensors"):
            keep_e = _whole_experts_in(lay, s, 78)[:1]
            part[s] = lambda n, k=keep_e: n.startswith("model.layers.78.") and _expert_id(n) in (None, *k)
    else:
        whole = {"model-1-of-61.safetensors"}
        part = {"model-2-of-61.safetensors": lambda n: _expert_id(n) in (None, 0, 383)}
    return whole, part


def build_slice(model, folder):
    whole, part = slice_spec(model)
    lay = layout(model)

    def keep(n):
        s = lay.tensors[n][2]
        return s in whole or part[s](n)
    write_replica(lay, folder, shards=whole | set(part), keep=keep)
    names = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    written = fill_random(folder, lay, names, seed=1)
    return folder, written



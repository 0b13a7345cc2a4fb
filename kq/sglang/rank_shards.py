"""`kq shard`'s per-rank files: each rank's slice of the routed experts, in the checkpoint's own layout.

Layout (kq's own format, not SGLang's `sharded_state`), inside the kq checkpoint folder:

    kq-shards/tp{T}-ep{P}/manifest.json
    kq-shards/tp{T}-ep{P}/ep{e}-tp{t}.safetensors      e < P, t < T/P (SGLang's moe_ep_rank, moe_tp_rank)

Each rank file holds, for every routed-expert layer `L` = `model.layers.N.mlp.experts` (checkpoint
names), that rank's experts (EP: experts [e*E/P, (e+1)*E/P)) and intermediate slice (TP: rows
[t*I/m, (t+1)*I/m) of gate and up, the same input columns of down, m = T/P), as stored in the
checkpoint (compressed-tensors pack-quantized: nibbles q + 8, eight per int32 along the input,
least-significant first; bf16 group scales) and stacked like SGLang's FusedMoE parameters:

    L.w13_weight_packed  int32 [E/P, 2*I/m, H/8]    gate rows, then up rows
    L.w13_weight_scale   bf16  [E/P, 2*I/m, H/g]
    L.w2_weight_packed   int32 [E/P, H, I/m/8]
    L.w2_weight_scale    bf16  [E/P, H, I/m/g]

These are exactly the slices SGLang's FusedMoE weight loader takes from the full checkpoint for
that rank, so a rank reads only its own bytes and the plugin prepacks them with the same call as
the full checkpoint's (kq/sglang/moe.py), in whatever layout the kernel in use needs. Each file's
safetensors metadata names the format. manifest.json: format, tp, ep, group, per-layer shapes,
sha256 and size of every file, and the sha256 of the checkpoint's kq-manifest.json they were cut
from. A folder of another format (kq-rank-shards/1 held kq's prepacked tiles) is refused with
one line: rerun `kq shard`.

Memory bound: one expert layer's INT4 tensors at a time.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kq.checkpoint.manifest import sha256_file
from kq.errors import KqError
from kq.format import EXPERT_PART_RE, MANIFEST_NAME, atomic_path, rank_file_name, rank_shard_dir, write_json_atomic

FORMAT = "kq-rank-shards/2"
# The tensors of one layer in a rank file: SGLang's FusedMoE parameter names, checkpoint layout.
PARAMS = ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale")
shard_dir = rank_shard_dir
rank_file = rank_file_name


@dataclass(frozen=True)
class ExpertLayer:
    name: str            # checkpoint prefix, e.g. model.layers.3.mlp.experts
    num_experts: int
    hidden: int
    intermediate: int


def expert_layers(reader) -> list[ExpertLayer]:
    """Routed-expert layers of a kq checkpoint, from tensor names and shapes only."""
    found: dict[str, set[int]] = {}
    for n in reader.names():
        m = EXPERT_PART_RE.match(n)
        if m and m["part"] == "packed":
            found.setdefault(m["layer"], set()).add(int(m["expert"]))
    layers = []
    for name in sorted(found, key=_layer_key):
        ids = found[name]
        if ids != set(range(len(ids))):
            raise KqError(f"{name}: expert ids are not 0..{len(ids) - 1}")
        _, (inter, _) = reader.meta(f"{name}.0.gate_proj.weight_packed")
        _, (hidden, _) = reader.meta(f"{name}.0.down_proj.weight_packed")
        layers.append(ExpertLayer(name, len(ids), hidden, inter))
    return layers


def _layer_key(name: str):
    m = re.search(r"layers\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)


def rank_slices(layer: ExpertLayer, tp: int, ep: int, tp_rank: int, ep_rank: int):
    """(expert ids, intermediate rows) a rank owns; the rule SGLang's FusedMoE loader applies."""
    per_ep = layer.num_experts // ep
    m = tp // ep
    i_tp = layer.intermediate // m
    return range(ep_rank * per_ep, (ep_rank + 1) * per_ep), slice(tp_rank * i_tp, (tp_rank + 1) * i_tp)


def check_split(layers: list[ExpertLayer], tp: int, ep: int, group: int) -> None:
    """The rules `kq inspect --tp/--ep` applies, with the numbers that fail."""
    if tp < 1 or ep < 1 or tp % ep:
        raise KqError(f"--tp {tp} --ep {ep}: the EP degree must divide the TP degree")
    m = tp // ep
    for ly in layers:
        if ly.num_experts % ep:
            raise KqError(f"{ly.name}: {ly.num_experts} experts do not split over EP {ep}")
        if ly.intermediate % m or (ly.intermediate // m) % group or (ly.intermediate // m) % 8:
            raise KqError(f"{ly.name}: expert intermediate {ly.intermediate} over {m} TP ranks gives "
                          f"{ly.intermediate / m:g} per rank, not a multiple of the group size {group}")


def cut_rank(reader, layer: ExpertLayer, tp: int, ep: int, tp_rank: int, ep_rank: int,
             group: int) -> dict[str, torch.Tensor]:
    """One rank's slices of one expert layer in the checkpoint layout ({PARAMS name: tensor}),
    where the reader's tensors are."""
    experts, rows = rank_slices(layer, tp, ep, tp_rank, ep_rank)
    cols = {"packed": slice(rows.start // 8, rows.stop // 8), "scale": slice(rows.start // group, rows.stop // group)}

    def t(e, proj, what):
        return reader.raw(f"{layer.name}.{e}.{proj}_proj.weight_{what}")

    out = {}
    for what in ("packed", "scale"):
        out[f"w13_weight_{what}"] = torch.stack([torch.cat([t(e, "gate", what)[rows], t(e, "up", what)[rows]])
                                                 for e in experts])
        out[f"w2_weight_{what}"] = torch.stack([t(e, "down", what)[:, cols[what]] for e in experts])
    return {k: out[k].contiguous() for k in PARAMS}


def write_rank_shards(folder: Path, tp: int, ep: int = 1) -> Path:
    """Write kq-shards/tp{tp}-ep{ep}/ for a finished kq checkpoint; returns that folder."""
    from kq.checkpoint.reader import CheckpointReader

    folder = Path(folder)
    kq_manifest = folder / MANIFEST_NAME
    if not kq_manifest.is_file():
        raise KqError(f"{folder}: no kq-manifest.json; not a finished kq checkpoint (run kq quantize first)")
    group = int(json.loads(kq_manifest.read_text()).get("options", {}).get("group_size", 0))
    reader = CheckpointReader(folder)
    try:
        layers = expert_layers(reader)
        if not layers:
            raise KqError(f"{folder}: no INT4 routed experts found")
        check_split(layers, tp, ep, group)
        out = shard_dir(folder, tp, ep)
        out.mkdir(parents=True, exist_ok=True)
        (out / "manifest.json").unlink(missing_ok=True)  # until rewritten, the folder reads as unfinished
        files = {}
        for ep_rank in range(ep):
            for tp_rank in range(tp // ep):
                tensors = {}
                for ly in layers:  # one layer's slices live at a time beside the rank's output
                    cut = cut_rank(reader, ly, tp, ep, tp_rank, ep_rank, group)
                    tensors.update({f"{ly.name}.{k}": v for k, v in cut.items()})
                name = rank_file(tp_rank, ep_rank)
                with atomic_path(out / name) as tmp:
                    save_file(tensors, str(tmp), metadata={"format": FORMAT})
                files[name] = {"sha256": sha256_file(out / name), "size": (out / name).stat().st_size}
        manifest = {
            "format": FORMAT, "tp": tp, "ep": ep, "group": group,
            "source_manifest_sha256": sha256_file(kq_manifest),
            "layers": {ly.name: {"num_experts": ly.num_experts, "hidden": ly.hidden,
                                 "intermediate": ly.intermediate} for ly in layers},
            "files": files,
        }
        write_json_atomic(out / "manifest.json", manifest)  # last: a folder without it is unfinished
        return out
    finally:
        reader.close()


def read_manifest(folder: Path, tp: int, ep: int) -> tuple[Path, dict] | None:
    """(rank folder, manifest) of `kq shard`'s files for TP/EP in a kq checkpoint folder, or None when
    there are none (or they are unfinished). KqError, one line, when they are of another format or
    were not cut from this checkpoint."""
    folder = Path(folder)
    d = shard_dir(folder, tp, ep)
    mf = d / "manifest.json"
    if not mf.is_file():
        return None
    m = json.loads(mf.read_text())
    rerun = f"rerun `kq shard {folder} --tp {tp} --ep {ep}`"
    if m.get("format") != FORMAT:
        raise KqError(f"kq: {d} holds per-rank files of format {m.get('format')!r}, not {FORMAT!r} "
                      f"(the checkpoint layout); {rerun} to rewrite them")
    src = folder / MANIFEST_NAME
    if not src.is_file() or sha256_file(src) != m.get("source_manifest_sha256"):
        raise KqError(f"kq: {d} was not cut from this checkpoint; delete it or {rerun}")
    return d, m


def read_rank(path: Path, layer: str, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """One layer's tensors ({PARAMS name: tensor}, checkpoint layout) from one rank file, on `device`
    (reads only that layer's bytes)."""
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        return {k: f.get_tensor(f"{layer}.{k}") for k in PARAMS}

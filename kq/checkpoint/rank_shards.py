"""`kq shard`: per-rank files of the routed experts, already prepacked for kq's kernels.

Layout (kq's own format, not SGLang's `sharded_state`), inside the kq checkpoint folder:

    kq-shards/tp{T}-ep{P}/manifest.json
    kq-shards/tp{T}-ep{P}/ep{e}-tp{t}.safetensors      e < P, t < T/P (SGLang's moe_ep_rank, moe_tp_rank)

Each rank file holds, for every routed-expert layer `model.layers.L.mlp.experts` (checkpoint
names), that rank's experts (EP: experts [e*E/P, (e+1)*E/P)) and intermediate slice (TP: rows
[t*I/m, (t+1)*I/m) of gate and up, the same columns of down, m = T/P), prepacked:
`{layer}.w13_q`, `.w13_s`, `.w2_q`, `.w2_s` — kq.kernels.PrepackedMoE's tensors. The slices are
exactly the ones SGLang's FusedMoE weight loader takes from the full checkpoint, so a rank
reads only its own bytes. manifest.json: format, tp, ep, group, per-layer shapes, sha256 of
every file, and the sha256 of the checkpoint's kq-manifest.json they were cut from.

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
from kq.kernels import PrepackedMoE, prepack_moe

FORMAT = "kq-rank-shards/1"
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


def cut_rank(reader, layer: ExpertLayer, tp: int, ep: int, tp_rank: int, ep_rank: int, group: int,
             device: torch.device | str | None = None) -> PrepackedMoE:
    """One rank's slices of one expert layer, prepacked on `device` (default: where the reader's
    tensors are) and returned there."""
    experts, rows = rank_slices(layer, tp, ep, tp_rank, ep_rank)
    cols_q = slice(rows.start // 8, rows.stop // 8)
    cols_s = slice(rows.start // group, rows.stop // group)

    def t(e, proj, what):
        return reader.raw(f"{layer.name}.{e}.{proj}_proj.weight_{what}")

    w13_q = torch.stack([torch.cat([t(e, "gate", "packed")[rows], t(e, "up", "packed")[rows]]) for e in experts])
    w13_s = torch.stack([torch.cat([t(e, "gate", "scale")[rows], t(e, "up", "scale")[rows]]) for e in experts])
    w2_q = torch.stack([t(e, "down", "packed")[:, cols_q] for e in experts])
    w2_s = torch.stack([t(e, "down", "scale")[:, cols_s] for e in experts])
    parts = [x.to(device).contiguous() if device is not None else x.contiguous() for x in (w13_q, w13_s, w2_q, w2_s)]
    return prepack_moe(*parts, group)


def default_device() -> torch.device:
    # The prepack is nibble shuffling in torch ops: about 0.02 GB/s of INT4 on a loaded 2-core CPU
    # (a full-size GLM-5.2 layer: ~5 min), milliseconds on a GPU. Same bytes either way.
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def write_rank_shards(folder: Path, tp: int, ep: int = 1, device: torch.device | str | None = None) -> Path:
    """Write kq-shards/tp{tp}-ep{ep}/ for a finished kq checkpoint; returns that folder.
    The prepack runs on `device` (default: the GPU when there is one); the files are the same."""
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
        device = torch.device(device) if device is not None else default_device()
        out = shard_dir(folder, tp, ep)
        out.mkdir(parents=True, exist_ok=True)
        files = {}
        for ep_rank in range(ep):
            for tp_rank in range(tp // ep):
                tensors = {}
                for ly in layers:  # one layer's slices live at a time beside the rank's output
                    pp = cut_rank(reader, ly, tp, ep, tp_rank, ep_rank, group, device)
                    tensors.update({f"{ly.name}.w13_q": pp.w13_q.cpu(), f"{ly.name}.w13_s": pp.w13_s.cpu(),
                                    f"{ly.name}.w2_q": pp.w2_q.cpu(), f"{ly.name}.w2_s": pp.w2_s.cpu()})
                name = rank_file(tp_rank, ep_rank)
                with atomic_path(out / name) as tmp:
                    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": FORMAT})
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


def read_rank(path: Path, layer: str, meta: dict, tp: int, ep: int, group: int,
              device: str | torch.device = "cpu") -> PrepackedMoE:
    """One layer's PrepackedMoE from one rank file (reads only that layer's bytes)."""
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        q13, s13, q2, s2 = (f.get_tensor(f"{layer}.{k}") for k in ("w13_q", "w13_s", "w2_q", "w2_s"))
    return PrepackedMoE(w13_q=q13, w13_s=s13, w2_q=q2, w2_s=s2, num_experts=meta["num_experts"] // ep,
                        hidden=meta["hidden"], intermediate=meta["intermediate"] // (tp // ep), group=group)

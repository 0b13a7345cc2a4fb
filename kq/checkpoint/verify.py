"""`kq verify`: is a kq checkpoint folder exactly what its manifest says, and is it
self-consistent (shapes, scales, config against tensors)?

Each problem is one line naming the file and, where it applies, the tensor.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from kq.checkpoint.index import INDEX_NAME, Index
from kq.checkpoint.manifest import IGNORED_DIRS, MANIFEST_NAME, read_manifest, sha256_file
from kq.checkpoint.safetensors_io import read_header
from kq.errors import KqError
from kq.format import expert_match

# Written after the manifest by later commands (model card, eval results).
ALLOWED_UNLISTED = {MANIFEST_NAME, "README.md", "kq-eval.json"}
FP8 = ("F8_E4M3", "F8_E5M2")


def _matches(name: str, targets: list[str]) -> bool:
    for t in targets:
        if t.startswith("re:"):
            if re.match(t[3:], name):
                return True
        elif t == name:
            return True
    return False


def verify_checkpoint(folder: str | Path, *, hashes: bool = True) -> list[str]:
    folder = Path(folder)
    if not folder.is_dir():
        raise KqError(f"{folder}: no such folder")
    man = read_manifest(folder)
    if man is None:
        if (folder / ".kq-work").exists():
            return [f"{MANIFEST_NAME}: missing; the folder holds an unfinished run (rerun `kq quantize` with the same options to finish it)"]
        return [f"{MANIFEST_NAME}: missing or not valid JSON: not a finished kq checkpoint"]
    problems: list[str] = []
    files = man.get("files", {})
    for name, rec in files.items():
        p = folder / name
        if not p.is_file():
            problems.append(f"{name}: listed in the manifest but missing")
            continue
        if p.stat().st_size != rec["size"]:
            problems.append(f"{name}: size {p.stat().st_size} differs from the manifest's {rec['size']}")
        elif hashes and sha256_file(p) != rec["sha256"]:
            problems.append(f"{name}: sha256 differs from the manifest")
    for p in sorted(folder.iterdir()):
        if p.name in files or p.name in ALLOWED_UNLISTED or p.name in IGNORED_DIRS:
            continue
        problems.append(f"{p.name}: not listed in the manifest")
    if problems:
        return problems  # tensors in a file that fails its hash are not worth reading

    try:
        config = json.loads((folder / "config.json").read_text())
        index = Index.from_json(json.loads((folder / INDEX_NAME).read_text()))
    except (OSError, json.JSONDecodeError, KqError) as e:
        return [f"config.json / {INDEX_NAME}: {e}"]
    headers = {}
    for shard in index.shards:
        try:
            headers[shard] = read_header(folder / shard).tensors
        except KqError as e:
            problems.append(str(e))
    if problems:
        return problems
    for name, shard in index.weight_map.items():
        if name not in headers[shard]:
            problems.append(f"{shard}: tensor {name} listed in the index is missing")
    for name, rec in man.get("tensors", {}).items():
        shard = rec["file"]
        e = headers.get(shard, {}).get(name)
        if e is None:
            problems.append(f"{shard}: tensor {name} listed in the manifest is missing")
        elif e.dtype != rec["dtype"] or list(e.shape) != rec["shape"]:
            problems.append(f"{shard}: tensor {name} is {e.dtype}{list(e.shape)}, manifest says {rec['dtype']}{rec['shape']}")
    problems += _check_config_and_scales(folder, config, index, headers)
    return problems


def _check_config_and_scales(folder: Path, config: dict, index: Index, headers) -> list[str]:
    from safetensors import safe_open
    problems = []
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "pack-quantized":
        return ["config.json: quantization_config is not compressed-tensors with top-level format pack-quantized"]
    groups = qc.get("config_groups", {})
    int4 = [g for g in groups.values() if g.get("weights", {}).get("num_bits") == 4]
    if len(int4) != 1:
        return ["config.json: expected exactly one INT4 config group"]
    g = int4[0]
    group = g["weights"].get("group_size")
    from kq.checkpoint.ct_config import FP8_ACTIVATION_GROUP, experts_fp8_activations
    try:
        if experts_fp8_activations(qc) and group != FP8_ACTIVATION_GROUP:
            problems.append(f"config.json: the INT4 group asks for FP8 activations at group {group}; "
                            f"SGLang's W4AFP8 MoE needs group {FP8_ACTIVATION_GROUP}")
    except KqError as e:
        problems.append(f"config.json: {e}")
    targets = g.get("targets", [])
    ignore = qc.get("ignore", [])
    linear_group = any("Linear" in gg.get("targets", []) for gg in groups.values())
    handles = {}

    def tensor(name):
        shard = index.weight_map[name]
        if shard not in handles:
            handles[shard] = safe_open(str(folder / shard), framework="pt")
        return handles[shard].get_tensor(name)

    wm = index.weight_map
    for name in wm:
        shard = wm[name]
        e = headers[shard][name]
        if name.endswith(".weight_packed"):
            mod = name[: -len(".weight_packed")]
            if not _matches(mod, targets):
                problems.append(f"{shard}: {mod} is INT4 but the INT4 config group's targets do not match it")
            for part in ("weight_scale", "weight_shape"):
                if f"{mod}.{part}" not in wm:
                    problems.append(f"{shard}: {mod}.{part} is missing")
            if f"{mod}.weight_scale" not in wm or f"{mod}.weight_shape" not in wm:
                continue
            out_f, in_f = tensor(f"{mod}.weight_shape").tolist()
            s = tensor(f"{mod}.weight_scale")
            if list(e.shape) != [out_f, in_f // 8]:
                problems.append(f"{shard}: {name} has shape {list(e.shape)}, expected {[out_f, in_f // 8]} for weight_shape {[out_f, in_f]}")
            if list(s.shape) != [out_f, in_f // group]:
                problems.append(f"{wm[mod + '.weight_scale']}: {mod}.weight_scale has shape {list(s.shape)}, expected {[out_f, in_f // group]} (group {group})")
            _check_scale(problems, wm[mod + ".weight_scale"], mod + ".weight_scale", s)
        elif name.endswith(".weight") and e.dtype in FP8:
            mod = name[: -len(".weight")]
            # A routed expert the INT4 group does not target was kept on purpose (kq quantize --keep-mtp).
            if expert_match(name) and _matches(mod, targets):
                problems.append(f"{shard}: {name} is a routed expert left in FP8 though the INT4 group targets it")
            if _matches(mod, ignore) or not linear_group:
                problems.append(f"{shard}: {mod} is FP8 but the config would load it unquantized")
            sname = mod + ".weight_scale"
            if sname not in wm:
                problems.append(f"{shard}: {sname} is missing")
            else:
                _check_scale(problems, wm[sname], sname, tensor(sname))
        elif name.endswith(".weight") and len(e.shape) == 2 and e.dtype not in FP8 and not name.endswith("embed_tokens.weight"):
            mod = name[: -len(".weight")]
            if linear_group and not _matches(mod, ignore):
                problems.append(f"{shard}: {mod} is {e.dtype} but not in the config's ignore list")
    return problems


def _check_scale(problems: list[str], shard: str, name: str, s: torch.Tensor) -> None:
    sf = s.to(torch.float32)
    if not torch.isfinite(sf).all():
        problems.append(f"{shard}: {name} holds NaN or Inf")
    elif (sf == 0).any():
        problems.append(f"{shard}: {name} holds zero scales")

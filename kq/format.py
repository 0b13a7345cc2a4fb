"""The format contracts every stage shares, written once: INT4 packing, which tensors are routed
experts, the group / TP / Marlin divisibility rules, the file names of a kq checkpoint, and the
atomic write (temp file + fsync + rename).

Ground floor: imports nothing from kq, so every package (recipes, checkpoint, kernels, quantize,
sglang, publish, cli) can stand on it.
"""
from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from pathlib import Path

import torch

# --- INT4 packing (compressed-tensors `pack-quantized`, symmetric) --------------------------------
# Codes q in [-8, 7] are stored as nibble q + 8; eight nibbles per int32 along the *input*
# dimension, least-significant first: input column 8*w + k sits in bits [4k, 4k+4) of word w.

NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)       # bit offset of nibble 0..7


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/8] int32 -> [..., K] uint8 stored nibbles (0..15, q + 8), column order restored."""
    nib = (packed.unsqueeze(-1) >> NIBBLE_SHIFTS.to(packed.device)) & 0xF    # [..., K/8, 8]
    return nib.to(torch.uint8).flatten(-2)


def pack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """Inverse of unpack_nibbles: [..., K] values 0..15 -> [..., K/8] int32."""
    n = nibbles.to(torch.int32).unflatten(-1, (-1, 8))                 # [..., K/8, 8]
    out = torch.zeros(n.shape[:-1], dtype=torch.int32, device=n.device)
    for k in range(8):
        out |= n[..., k] << (4 * k)          # int32 shift wraps for k = 7: bits are what matter
    return out


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q int8 [out, in] in [-8, 7], in % 8 == 0  ->  int32 [out, in/8]."""
    assert q.shape[-1] % 8 == 0, "input dim must be a multiple of 8"
    return pack_nibbles(q.to(torch.int32) + 8)


def unpack_int4(packed: torch.Tensor, n_in: int | None = None) -> torch.Tensor:
    """int32 [out, in/8] -> int8 codes [out, in] in [-8, 7]."""
    q = unpack_nibbles(packed).to(torch.int8) - 8
    return q if n_in is None else q[..., :n_in]


# --- routed experts -------------------------------------------------------------------------------
# The same rule for every family: `…layers.L.mlp.experts.E.{gate,up,down}_proj`.

# A source weight that kq quantizes (the prefix is the Linear's module name).
EXPERT_RE = re.compile(
    r"^(?P<prefix>(?:language_model\.)?model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate|up|down)_proj)\.weight$")
# An expert tensor kq wrote (the layer is the experts' module name, part the compressed-tensors part).
EXPERT_PART_RE = re.compile(
    r"^(?P<layer>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight_(?P<part>packed|scale|shape)$")
# compressed-tensors' target for the INT4 group in config.json (checkpoint names and SGLang's
# per-expert module names); SGLang and kq's detector compare it as a string, so it never changes.
EXPERT_TARGET = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"


def expert_match(name: str):
    """The EXPERT_RE match of a source tensor name, or None."""
    return EXPERT_RE.match(name)


# --- group, TP and Marlin divisibility ------------------------------------------------------------
GROUP_SIZES = (32, 64, 128)
TP_DEGREES = (1, 2, 4, 8)
MARLIN_TILE = 64  # SGLang's Marlin MoE needs I/TP to be a multiple of 64 (REFERENCE.md §3)


def check_group(group: int, k: int, what: str) -> None:
    """ValueError unless `group` is a supported group size dividing an input size of k."""
    if group not in GROUP_SIZES:
        raise ValueError(f"{what}: group size {group} is not one of {GROUP_SIZES}")
    if k % group:
        raise ValueError(f"{what}: input size {k} is not a multiple of the group size {group}")


def split_failures(intermediate: int, ranks: int, group: int, *, marlin: bool = True) -> list[str] | None:
    """Why an expert intermediate of `intermediate` rows split over `ranks` TP ranks fails to load:
    None if it does not split evenly, else the failed rules (empty when it loads), each worded
    "not a multiple of …" so callers can prefix the per-rank size."""
    if intermediate % ranks:
        return None
    per = intermediate // ranks
    bad = [f"not a multiple of group {group}"] if per % group else []
    if marlin and per % MARLIN_TILE:
        bad.append(f"not a multiple of {MARLIN_TILE} (Marlin)")
    return bad


# --- file names of a kq checkpoint ----------------------------------------------------------------
CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MANIFEST_NAME = "kq-manifest.json"     # written last: a folder without it is not finished
EVAL_NAME = "kq-eval.json"
WORK_DIR = ".kq-work"                  # an unfinished run's resume state
RANK_SHARDS_DIR = "kq-shards"          # `kq shard`'s per-rank files


def rank_shard_dir(folder: str | Path, tp: int, ep: int) -> Path:
    return Path(folder) / RANK_SHARDS_DIR / f"tp{tp}-ep{ep}"


def rank_file_name(tp_rank: int, ep_rank: int) -> str:
    return f"ep{ep_rank}-tp{tp_rank}.safetensors"


# --- atomic writes --------------------------------------------------------------------------------

@contextmanager
def atomic_path(path: str | Path, tmp_name: str | None = None):
    """Yields a temp path beside `path` to write; on success it is fsynced and renamed onto `path`
    (readers see the old file or the new one, never half of one); on error it is removed."""
    path = Path(path)
    tmp = path.with_name(tmp_name or path.name + ".tmp")
    try:
        yield tmp
        if tmp.is_file():
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if tmp.is_file():
            tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str, tmp_name: str | None = None) -> None:
    with atomic_path(path, tmp_name) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | Path, data, indent: int = 2, tmp_name: str | None = None,
                      end: str = "\n") -> None:
    write_text_atomic(path, json.dumps(data, indent=indent) + end, tmp_name)

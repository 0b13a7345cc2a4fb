"""Reading `kq shard` per-rank files inside SGLang (format: kq/checkpoint/rank_shards.py).

When `<model>/kq-shards/tp{T}-ep{P}/manifest.json` exists for the running TP/EP layout and was
cut from this checkpoint (hash of kq-manifest.json), each rank's MoE layers take their
prepacked experts from `ep{e}-tp{t}.safetensors`, and the plugin's weight-iterator filter skips
the routed-expert tensors of the full checkpoint, so a rank reads only its own expert bytes.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from kq.checkpoint.manifest import sha256_file
from kq.checkpoint.rank_shards import read_rank, rank_file, shard_dir
from kq.format import EXPERT_PART_RE



@lru_cache(maxsize=None)
def _manifest(folder: str, tp: int, ep: int):
    d = shard_dir(Path(folder), tp, ep)
    mf = d / "manifest.json"
    if not mf.is_file():
        return None
    m = json.loads(mf.read_text())
    src = Path(folder) / "kq-manifest.json"
    if m.get("format") != "kq-rank-shards/1" or not src.is_file() or sha256_file(src) != m["source_manifest_sha256"]:
        raise ValueError(f"kq: {d} was not cut from this checkpoint (or is another format); "
                         f"delete it or rerun `kq shard {folder} --tp {tp} --ep {ep}`")
    return str(d), m


def _layout():
    """(model folder, TP, EP, moe_tp_rank, moe_ep_rank) of this SGLang process, or None."""
    try:
        from sglang.srt.runtime_context import get_parallel, get_server_args

        par = get_parallel()
        folder = get_server_args().model_path
        return folder, par.moe_tp_size * par.moe_ep_size, par.moe_ep_size, par.moe_tp_rank, par.moe_ep_rank
    except Exception:
        return None


def _checkpoint_layer(folder: str, prefix: str) -> str:
    # SGLang's MTP draft model names its decoder `model.decoder`; the checkpoint keeps layer N.
    if prefix.startswith("model.decoder."):
        n = json.loads((Path(folder) / "config.json").read_text())["num_hidden_layers"]
        return f"model.layers.{n}." + prefix[len("model.decoder."):]
    return prefix


def find_for_layer(layer, prefix: str, group: int):
    lay = _layout()
    if lay is None or not Path(str(lay[0])).is_dir():
        return None
    folder, tp, ep, tp_rank, ep_rank = lay
    found = _manifest(str(folder), tp, ep)
    if found is None:
        return None
    d, m = found
    name = _checkpoint_layer(str(folder), prefix)
    if name not in m["layers"]:
        return None
    if m["group"] != group:
        raise ValueError(f"kq: {d}: group {m['group']} differs from the checkpoint's {group}")
    return {"path": str(Path(d) / rank_file(tp_rank, ep_rank)), "layer": name, "meta": m["layers"][name],
            "tp": tp, "ep": ep, "group": group}


def load_prepacked(info: dict, device):
    return read_rank(Path(info["path"]), info["layer"], info["meta"], info["tp"], info["ep"], info["group"],
                     device=device)


def skip_predicate(files):
    """For SGLang's safetensors iterator: names to skip because per-rank files provide them."""
    lay = _layout()
    if lay is None or not files:
        return None
    folder = str(Path(files[0]).parent)
    found = _manifest(folder, lay[1], lay[2])
    if found is None:
        return None
    layers = set(found[1]["layers"])

    def skip(name: str) -> bool:
        mt = EXPERT_PART_RE.match(name)
        return bool(mt) and mt["layer"] in layers

    return skip

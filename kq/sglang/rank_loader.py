"""Reading `kq shard` per-rank files inside SGLang (format: kq/sglang/rank_shards.py).

When `<model>/kq-shards/tp{T}-ep{P}/manifest.json` exists for the running TP/EP layout and was
cut from this checkpoint (hash of kq-manifest.json), each rank's MoE layers take their experts
from `ep{e}-tp{t}.safetensors` (the checkpoint-layout slices SGLang's weight loader would have put
in the layer's parameters), and the plugin's weight-iterator filter skips the routed-expert
tensors of the full checkpoint, so a rank reads only its own expert bytes. Files of another
format, or cut from another checkpoint, are refused with one line (rerun `kq shard`).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from kq.format import EXPERT_PART_RE
from kq.sglang.rank_shards import PARAMS, rank_file, read_manifest, read_rank


@lru_cache(maxsize=None)
def _manifest(folder: str, tp: int, ep: int):
    found = read_manifest(Path(folder), tp, ep)
    return None if found is None else (str(found[0]), found[1])


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
    return {"path": str(Path(d) / rank_file(tp_rank, ep_rank)), "layer": name}


def fill_params(layer, info: dict) -> None:
    """Put the rank file's tensors in the layer's checkpoint-layout parameters (w13_weight_packed, …),
    where SGLang's weight loader would have put the same slices of the full checkpoint."""
    params = {k: getattr(layer, k) for k in PARAMS}
    got = read_rank(Path(info["path"]), info["layer"], device=params[PARAMS[0]].device)
    for k, p in params.items():
        t = got[k]
        if t.shape != p.shape or t.dtype != p.dtype:
            raise ValueError(f"kq: {info['path']}: {info['layer']}.{k} is {t.dtype} {list(t.shape)}, this rank's "
                             f"layer expects {p.dtype} {list(p.shape)}; rerun `kq shard`")
        p.data = t


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

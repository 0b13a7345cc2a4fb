"""kq's SGLang plugin inside SGLang 0.5.23 on the CPU (run in the side venv by test_plugin.py).

    python check_plugin.py KQ_CHECKPOINT --out result.json

Everything goes through SGLang's own code: its plugin loader (entry points of the installed
kq), its argument parser, and its `FusedMoE` layer class built for 8 simulated TP ranks (and
TP 8 x EP 2), whose own `weight_loader` fills kq's MoE method's parameters from the checkpoint
tensors the way SGLang's DeepSeek/GLM model `load_weights` feeds them. The GPU is simulated
only where SGLang asks (capability 9.0; the loader's CPU-only padded path is switched off so
the GPU path is the one exercised). Writes a JSON report; tensors are compared here and only
the verdicts and a few numbers go out.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from pathlib import Path

import torch


def _plugin_facts(folder: str) -> dict:
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", folder, "--quantization", "kq", "--device", "cpu"])
    return {
        "methods_first": next(iter(QUANTIZATION_METHODS)),
        "kq_class": QUANTIZATION_METHODS.get("kq").__name__ if "kq" in QUANTIZATION_METHODS else None,
        "kq_in_choices": "kq" in QUANTIZATION_CHOICES,
        "parsed_quantization": args.quantization,
    }


def _expert_tensors(folder: str, layer: str):
    from kq.checkpoint.reader import CheckpointReader

    r = CheckpointReader(folder)
    names = [n for n in r.names() if n.startswith(layer + ".") and ".weight_" in n]
    return {n: r.raw(n).clone() for n in names}, r


def _build_layer(qc, prefix, n_experts, hidden, inter, tp, ep, tp_rank, ep_rank, rsf, top_k=2, device="cpu"):
    """SGLang's FusedMoE as TP rank tp_rank of EP rank ep_rank would build it (also benchmarks/sglang_check.py)."""
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(moe_tp_size=tp // ep, moe_tp_rank=tp_rank, moe_ep_size=ep, moe_ep_rank=ep_rank), \
            torch.device(device):
        layer = FusedMoE(num_experts=n_experts, hidden_size=hidden, intermediate_size=inter, layer_id=1,
                         top_k=top_k, params_dtype=torch.bfloat16, quant_config=qc, prefix=prefix,
                         routed_scaling_factor=rsf)
    return layer


def _load(layer, tensors, layer_prefix, n_experts):
    """What SGLang's DeepseekV2/Glm4Moe load_weights does for routed experts. `tensors`: any
    object with items() yielding (checkpoint name, tensor) of this layer's expert tensors."""
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

    mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", n_experts)
    params = dict(layer.named_parameters())
    for name, w in tensors.items():
        local = name[len(layer_prefix) - len("experts"):]  # "experts.E.gate_proj.weight_packed"
        for param_name, weight_name, expert_id, shard_id in mapping:
            if local.startswith(weight_name):
                pname = local.replace(weight_name, param_name)  # experts.w13_weight_packed
                p = params[pname[len("experts."):]]
                p.weight_loader(p, w, pname, shard_id=shard_id, expert_id=expert_id)
                break
        else:
            raise AssertionError(f"no mapping for {name}")


def _full(tensors, layer, n_experts, group):
    """Unsharded stacks in SGLang's w13/w2 layout straight from the checkpoint tensors."""
    def t(e, p, w):
        return tensors[f"{layer}.{e}.{p}_proj.weight_{w}"]
    return {
        "w13_weight_packed": torch.stack([torch.cat([t(e, "gate", "packed"), t(e, "up", "packed")]) for e in range(n_experts)]),
        "w13_weight_scale": torch.stack([torch.cat([t(e, "gate", "scale"), t(e, "up", "scale")]) for e in range(n_experts)]),
        "w2_weight_packed": torch.stack([t(e, "down", "packed") for e in range(n_experts)]),
        "w2_weight_scale": torch.stack([t(e, "down", "scale") for e in range(n_experts)]),
    }


def _reassemble(per_rank, tp, ep):
    """Inverse of the TP/EP split: experts concatenated over EP ranks, gate and up rows (w13) and
    down's input columns (w2) concatenated over TP ranks."""
    m = tp // ep
    out = {}
    for name in per_rank[(0, 0)]:
        by_ep = []
        for e in range(ep):
            parts = [per_rank[(e, t)][name] for t in range(m)]
            if name.startswith("w13"):
                gate = torch.cat([p[:, : p.shape[1] // 2] for p in parts], 1)
                up = torch.cat([p[:, p.shape[1] // 2:] for p in parts], 1)
                by_ep.append(torch.cat([gate, up], 1))
            else:
                by_ep.append(torch.cat(parts, 2))
        out[name] = torch.cat(by_ep, 0)
    return out


def _moe_check(folder: str, tp: int, ep: int) -> dict:
    from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    import sglang.srt.layers.moe.fused_moe_triton.layer as fl
    from kq.sglang.rank_shards import rank_file, read_rank, shard_dir
    from kq.kernels import fused_moe_w4a16, prepack_moe
    from kq.sglang.config import KqConfig

    fl._is_cpu = False  # the GPU loading path (the CPU one pads); see module docstring
    cfg = json.loads((Path(folder) / "config.json").read_text())
    qc = KqConfig.from_config(cfg["quantization_config"])
    group = qc.target_scheme_map[next(iter(qc.target_scheme_map))]["weights"].group_size
    prefix = "model.layers.1.mlp.experts"
    tensors, reader = _expert_tensors(folder, prefix)
    n_experts, hidden, inter = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    rsf = float(cfg.get("routed_scaling_factor", 1.0))
    full = _full(tensors, prefix, n_experts, group)

    torch.manual_seed(0)
    T, k = 5, 2
    x = (torch.randn(T, hidden) * 0.5).to(torch.bfloat16)
    topk_ids = torch.stack([torch.randperm(n_experts)[:k] for _ in range(T)]).to(torch.int32)
    topk_w = torch.rand(T, k).float()
    ref = fused_moe_w4a16(x, prepack_moe(full["w13_weight_packed"], full["w13_weight_scale"],
                                         full["w2_weight_packed"], full["w2_weight_scale"], group),
                          topk_w, topk_ids, routed_scaling_factor=rsf).float()

    per_rank, methods, acc = {}, set(), torch.zeros(T, hidden)
    used_rank_files, process_matches = set(), True
    shards = shard_dir(Path(folder), tp, ep)
    matches_shard_files = True if (shards / "manifest.json").is_file() else None
    m = tp // ep
    per_ep = n_experts // ep
    for e in range(ep):
        for t in range(m):
            layer = _build_layer(qc, prefix, n_experts, hidden, inter, tp, ep, t, e, rsf)
            methods.add(type(layer.quant_method).__name__)
            _load(layer, tensors, prefix, n_experts)
            loaded = {n: getattr(layer, n).data.clone() for n in full}
            per_rank[(e, t)] = loaded
            # kq's prepack of what SGLang's loader put on this rank.
            mine = prepack_moe(loaded["w13_weight_packed"], loaded["w13_weight_scale"],
                               loaded["w2_weight_packed"], loaded["w2_weight_scale"], group)
            used_rank_files.add(layer.kq_rank_files is not None)
            layer.quant_method.process_weights_after_loading(layer)
            for a in ("w13_q", "w13_s", "w2_q", "w2_s"):
                process_matches &= torch.equal(getattr(mine, a), getattr(layer.kq_moe, a))
            if matches_shard_files is not None:
                # kq shard's file for this rank holds exactly what SGLang's loader put on it.
                got = read_rank(shards / rank_file(t, e), prefix)
                matches_shard_files &= got.keys() == loaded.keys()
                for a in loaded:
                    matches_shard_files &= got[a].dtype == loaded[a].dtype and torch.equal(got[a], loaded[a])
            # SGLang's standard dispatcher hands local ids (-1: expert on another EP rank).
            local = torch.where((topk_ids // per_ep) == e, topk_ids % per_ep, torch.full_like(topk_ids, -1))
            disp = StandardDispatchOutput(hidden_states=x, hidden_states_scale=None,
                                          topk_output=StandardTopKOutput(topk_w, local, None))
            acc += layer.quant_method.apply(layer, disp).hidden_states.float()  # = the all-reduce
    again = _reassemble(per_rank, tp, ep)
    reader.close()
    return {
        "methods": sorted(methods),
        "ranks": len(per_rank),
        "reassembles_exactly": all(torch.equal(again[n], full[n]) for n in full),
        "rank0_w13_shape": list(per_rank[(0, 0)]["w13_weight_packed"].shape),
        "matches_kq_shard_files": matches_shard_files,
        "used_rank_files": sorted(used_rank_files),
        "process_weights_matches_prepack": process_matches,
        "apply_sum_max_abs_err": float((acc - ref).abs().max()),
        "ref_max_abs": float(ref.abs().max()),
    }


def _iterator_filter(folder: str) -> dict:
    """SGLang's safetensors iterator after the plugin: with per-rank files for the running layout
    it yields no routed-expert tensor of the full checkpoint; without, everything."""
    from sglang.srt.model_loader import loader
    from sglang.srt.runtime_context import get_parallel

    files = sorted(str(p) for p in Path(folder).glob("*.safetensors"))
    res = {}
    for tp, ep in ((8, 1), (8, 2), (4, 1)):
        with get_parallel().override(tp_size=tp, attn_tp_size=tp, moe_tp_size=tp // ep, moe_ep_size=ep, moe_tp_rank=0, moe_ep_rank=0):
            # Both of SGLang's iterators, called as its DefaultModelLoader calls them.
            runs = {
                "single": loader.safetensors_weights_iterator(
                    files, disable_mmap=False, prefetch=False, prefetch_num_threads=4, drop_cache_after_load=False),
                "threaded": loader.buffered_multi_thread_safetensors_weights_iterator(
                    files, max_workers=8, disable_mmap=False, prefetch=False, prefetch_num_threads=4,
                    drop_cache_after_load=False),
            }
            for kind, it in runs.items():
                got = [(n, t) for n, t in it]
                names = [n for n, _ in got]
                res[f"tp{tp}-ep{ep}-{kind}"] = {
                    "total": len(names), "unique": len(set(names)),
                    "experts": sum(".mlp.experts." in n and "_proj.weight_" in n for n in names),
                    "bytes": sum(t.numel() * t.element_size() for _, t in got)}
    return res


def _draft_rank_files(folder: str):
    """The MTP draft's layer (SGLang: model.decoder.mlp.experts) finds the checkpoint's last layer."""
    from kq.sglang import rank_loader
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(moe_tp_size=8, moe_ep_size=1, moe_tp_rank=3, moe_ep_rank=0):
        info = rank_loader.find_for_layer(None, "model.decoder.mlp.experts", 32)
    return info and {"layer": info["layer"], "file": Path(info["path"]).name}


def _refuses_bad_split(folder: str) -> str:
    from kq.sglang.config import KqConfig

    cfg = json.loads((Path(folder) / "config.json").read_text())
    qc = KqConfig.from_config(cfg["quantization_config"])
    # Intermediate 128 over 8 ranks = 16 per rank: not a multiple of group 32.
    try:
        _build_layer(qc, "model.layers.1.mlp.experts", cfg["n_routed_experts"], cfg["hidden_size"],
                     128, 8, 1, 0, 0, 1.0)
    except ValueError as e:
        return str(e)
    return ""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--bad-split-folder", help="a kq checkpoint whose experts do not split over TP 8")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)

    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    load_plugins()  # SGLang's own entry-point loader: finds kq through the installed metadata
    res = {"plugin": _plugin_facts(args.folder)}
    publish(ServerArgs(model_path=args.folder, tp_size=8, device="cpu"), role="scheduler")
    res["tp8"] = _moe_check(args.folder, 8, 1)
    res["tp8_ep2"] = _moe_check(args.folder, 8, 2)
    res["iterator"] = _iterator_filter(args.folder)
    res["draft_rank_files"] = _draft_rank_files(args.folder)
    if args.bad_split_folder:
        res["bad_split_error"] = _refuses_bad_split(args.bad_split_folder)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

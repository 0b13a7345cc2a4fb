"""Time kq's GPTQ on one full-size GLM-5.2 MoE decoder layer (generated weights) on one GPU.

    python benchmarks/gptq_layer_gpu.py                       # 128 x 4096 calibration tokens
    python benchmarks/gptq_layer_gpu.py --samples 512 --seqlen 4096 --expert-chunk 32

Generates (once) a one-layer checkpoint with GLM-5.2's real shapes (hidden 6144, MLA,
DSA indexer, 256 routed experts of 2048 + 1 shared, block FP8) under --work, then runs
the layer-wise GPTQ steps kq runs per layer, each timed with the GPU synchronised:
load (FP8 -> dequantized layer on the GPU), MoE inputs (attention forward of every
window, stopped at the MoE block), GPTQ of all 256 experts (Hessians, routing,
gate/up then down), propagation (the whole layer again with the INT4 experts), and
saving the packed results + next activations. Prints a JSON line and the projected
single-GPU time for GLM-5.2's 75 MoE layers (+ 3 dense layers, which only propagate).
Memory: the layer (bf16 by default) + hidden states and MoE inputs of all windows
(2 x tokens x 6144 x 4 bytes; 128 x 4096 tokens: 12.9 GB) + expert-chunk Hessians
(chunk x 6144^2 x 4 bytes). Random token ids stand in for text (the weights are random).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kq.checkpoint.reader import CheckpointReader  # noqa: E402
from kq.model import LayerwiseModel  # noqa: E402
from kq.quantize.layerwise import (GptqConfig, _moe_inputs, _packed_tensors, _save_acts,  # noqa: E402
                                   _set_experts, quantize_experts)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/kq-gptq-layer"))
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--expert-chunk", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1, help="windows per forward (attention memory grows with it)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--policy", default="all", choices=["routed", "weighted", "all"])
    ap.add_argument("--tiny", action="store_true", help="smoke run on tiny shapes (CPU ok)")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ckpt = a.work / ("tiny-one-layer" if a.tiny else "glm52-one-layer")
    t = {}
    if not (ckpt / "model.safetensors.index.json").exists():
        from kq.synth import generate, generate_layer_shapes
        t0 = time.time()
        if a.tiny:
            generate("glm5", ckpt, seed=0, num_layers=1, first_k_dense=0, mtp=False)
        else:
            generate_layer_shapes("glm5", ckpt, seed=0, num_layers=1)
        t["generate_s"] = round(time.time() - t0, 1)
    model = LayerwiseModel(CheckpointReader(ckpt), dtype=getattr(torch, a.dtype), device=dev)
    cfg = GptqConfig(group=a.group, policy=a.policy, expert_chunk=a.expert_chunk, batch=a.batch)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (a.samples, a.seqlen), generator=torch.Generator().manual_seed(0))
    hidden = [model.embed(c) for c in ids.split(a.batch)]
    carry: list = [None] * len(hidden)
    torch.cuda.reset_peak_memory_stats() if dev.type == "cuda" else None

    def phase(name, fn):
        sync()
        t0 = time.time()
        r = fn()
        sync()
        t[name] = round(time.time() - t0, 2)
        print(f"{name}: {t[name]} s", file=sys.stderr, flush=True)
        return r

    layer = phase("load_s", lambda: model.load_layer(0))
    X = phase("moe_inputs_s", lambda: _moe_inputs(model, layer, hidden, carry))
    res, stats = phase("gptq_s", lambda: quantize_experts(layer, X, cfg))
    del X
    phase("set_experts_s", lambda: _set_experts(layer, res, cfg.group))

    def propagate():
        for b in range(len(hidden)):
            hidden[b], carry[b] = model.forward_layer(layer, hidden[b], carry[b])
    phase("propagate_s", propagate)
    a.work.mkdir(parents=True, exist_ok=True)

    def save():
        from safetensors.torch import save_file
        save_file(_packed_tensors(model.layer_prefix(0), res), str(a.work / "layer-0000.safetensors"))
        _save_acts(a.work / "acts-0001.safetensors", hidden, carry)
    phase("save_s", save)
    moe_layer = sum(v for k, v in t.items() if k != "generate_s")
    dense = t["moe_inputs_s"] + t["propagate_s"]  # a dense layer only loads and propagates (upper bound)
    out = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
        "tokens": a.samples * a.seqlen, "group": a.group, "policy": a.policy, "dtype": a.dtype,
        "expert_chunk": a.expert_chunk, **t, "moe_layer_s": round(moe_layer, 1),
        "rtn_fallback_experts": len(stats["rtn_fallback"]),
        "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1) if dev.type == "cuda" else None,
        "projected_glm52_hours": round((75 * moe_layer + 3 * (dense + t["load_s"])) / 3600, 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()

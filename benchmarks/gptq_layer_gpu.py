"""Time kq's GPTQ on one full-size GLM-5.2 MoE decoder layer (generated weights) on one GPU.

    python3 benchmarks/gptq_layer_gpu.py                     # H200: 64 x 4096 tokens, projected to 512 x 4096
    python3 benchmarks/gptq_layer_gpu.py --samples 128 --seqlen 4096 --expert-chunk 32
    python benchmarks/gptq_layer_gpu.py --tiny --device cpu  # dry run of every stage on tiny shapes

Generates (once) a one-layer checkpoint with GLM-5.2's real shapes (hidden 6144, MLA,
DSA indexer, 256 routed experts of 2048 + 1 shared, block FP8) under --work, then runs
the layer-wise GPTQ steps kq runs per layer (kq.quantize.layerwise), each timed with the
GPU synchronised and printed as it ends:
  load         FP8 -> dequantized layer on the device
  moe_inputs   every window through attention, stopped at the MoE block
  gptq         all 256 experts: routing, Hessians, down-projection inputs (these scale with
               the tokens: 'hessians') and the GPTQ solver itself (token-independent: 'solver',
               timed by wrapping kq.quantize.layerwise.gptq_quantize)
  set_experts  dequantized INT4 experts into the layer
  propagate    every window through the whole layer with the INT4 experts
  save         packed results + the next layer's activations (what a resumable run writes)
Then projects the per-layer time to --project-samples x seqlen tokens (default 512 x 4096)
by scaling the token-proportional stages (moe_inputs, hessians, propagate, save) by the token
ratio, and the whole single-GPU GLM-5.2 run: 75 MoE layers + 3 dense layers (a dense layer
costs at most its load + forward: moe_inputs + propagate, an upper bound). Prints one JSON line.
--deadline-s: no stage starts past it (the JSON then says which stages are missing).
Memory: the layer (bf16 by default) + hidden states (tokens x 6144 x 2 bytes) + MoE inputs
X (tokens x 6144 x 4 bytes; 64 x 4096 tokens: 6.4 GB) + with policy `all` one expert's
gate/up outputs on every token (tokens x 4096 x 4 bytes) + expert-chunk Hessians
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
import kq.quantize.layerwise as lw  # noqa: E402

MOE_LAYERS, DENSE_LAYERS = 75, 3   # GLM-5.2: 78 decoder layers, the first 3 dense


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/kq-gptq-layer"))
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--project-samples", type=int, default=512, help="project the per-layer time to this many "
                    "windows of --seqlen tokens")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--expert-chunk", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1, help="windows per forward (attention memory grows with it)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--policy", default="all", choices=["routed", "weighted", "all"])
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--refit", action="store_true", help="also time --gptq-refit-scales")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--deadline-s", type=float, default=270, help="no stage starts after this (0: none)")
    ap.add_argument("--no-save", action="store_true", help="skip writing results + activations")
    ap.add_argument("--tiny", action="store_true", help="dry run on tiny shapes (CPU ok; projections meaningless)")
    a = ap.parse_args()
    t_start = time.time()
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    cuda = dev.type == "cuda"

    def log(msg):
        print(f"[{time.time() - t_start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    log(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, "
        f"{a.samples} x {a.seqlen} tokens (projection: {a.project_samples} x {a.seqlen}), group {a.group}, "
        f"policy {a.policy}, expert chunk {a.expert_chunk}, {a.dtype}")
    ckpt = a.work / ("tiny-one-layer" if a.tiny else "glm52-one-layer")
    t: dict = {}
    missing: list = []
    if not (ckpt / "model.safetensors.index.json").exists():
        from kq.synth import generate, generate_layer_shapes
        t0 = time.time()
        if a.tiny:
            generate("glm5", ckpt, seed=0, num_layers=1, first_k_dense=0, mtp=False, overwrite=True)
        else:
            generate_layer_shapes("glm5", ckpt, seed=0, num_layers=1, overwrite=True)
        t["generate_s"] = round(time.time() - t0, 1)
        log(f"generated {ckpt} in {t['generate_s']} s")
    model = LayerwiseModel(CheckpointReader(ckpt), dtype=getattr(torch, a.dtype), device=dev)
    cfg = lw.GptqConfig(group=a.group, policy=a.policy, damp=a.damp, refit=a.refit, expert_chunk=a.expert_chunk,
                        batch=a.batch)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (a.samples, a.seqlen), generator=torch.Generator().manual_seed(0))
    hidden = [model.embed(c) for c in ids.split(a.batch)]
    carry: list = [None] * len(hidden)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    # The solver's share of the GPTQ stage (token-independent), timed inside quantize_experts.
    solver = {"s": 0.0, "calls": 0}
    inner = lw.gptq_quantize

    def timed_solver(*args, **kw):
        sync()
        t0 = time.time()
        r = inner(*args, **kw)
        sync()
        solver["s"] += time.time() - t0
        solver["calls"] += 1
        return r
    lw.gptq_quantize = timed_solver

    def phase(name, fn):
        if a.deadline_s and time.time() - t_start > a.deadline_s:
            missing.append(name)
            log(f"{name}: skipped (past --deadline-s {a.deadline_s})")
            return None
        log(f"{name} ...")
        sync()
        t0 = time.time()
        r = fn()
        sync()
        t[name + "_s"] = round(time.time() - t0, 2)
        mem = f", peak GPU {torch.cuda.max_memory_allocated() / 1e9:.1f} GB" if cuda else ""
        log(f"{name}: {t[name + '_s']} s{mem}")
        return r

    layer = phase("load", lambda: model.load_layer(0))
    X = phase("moe_inputs", lambda: lw._moe_inputs(model, layer, hidden, carry)) if layer is not None else None
    r = phase("gptq", lambda: lw.quantize_experts(layer, X, cfg)) if X is not None else None
    del X
    res, stats = r if r is not None else (None, {})
    if res is not None:
        t["gptq_solver_s"] = round(solver["s"], 2)
        t["gptq_hessians_s"] = round(t["gptq_s"] - solver["s"], 2)
        log(f"gptq split: solver {t['gptq_solver_s']} s ({solver['calls']} calls), routing + Hessians + down "
            f"inputs {t['gptq_hessians_s']} s")
        phase("set_experts", lambda: lw._set_experts(layer, res, cfg.group))

        def propagate():
            for b in range(len(hidden)):
                hidden[b], carry[b] = model.forward_layer(layer, hidden[b], carry[b])
        phase("propagate", propagate)
        if not a.no_save:
            a.work.mkdir(parents=True, exist_ok=True)

            def save():
                lw._atomic_save(lw._packed_tensors(model.layer_prefix(0), res), a.work / "layer-0000.safetensors")
                lw._save_acts(a.work / "acts-0001.safetensors", hidden, carry)
            phase("save", save)
    for n in ("load", "moe_inputs", "gptq", "set_experts", "propagate", "save"):
        if n + "_s" not in t and n not in missing and not (n == "save" and a.no_save):
            missing.append(n)
    scale = a.project_samples / a.samples
    g = t.get
    measured = sum(v for k, v in t.items() if k.endswith("_s") and k not in ("generate_s", "gptq_solver_s",
                                                                             "gptq_hessians_s"))
    fixed = g("load_s", 0) + g("gptq_solver_s", 0) + g("set_experts_s", 0)
    per_token = g("moe_inputs_s", 0) + g("gptq_hessians_s", 0) + g("propagate_s", 0) + g("save_s", 0)
    proj_layer = fixed + scale * per_token
    dense = g("load_s", 0) + scale * (g("moe_inputs_s", 0) + g("propagate_s", 0))
    out = {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "shapes": "tiny (dry run)" if a.tiny else "GLM-5.2 full layer (hidden 6144, 256 experts x 2048)",
        "tokens": a.samples * a.seqlen, "samples": a.samples, "seqlen": a.seqlen, "group": a.group,
        "policy": a.policy, "damp": a.damp, "refit": a.refit, "dtype": a.dtype, "expert_chunk": a.expert_chunk,
        **t, "moe_layer_s": round(measured, 1), "missing_stages": missing,
        "rtn_fallback_experts": len(stats.get("rtn_fallback", [])),
        "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1) if cuda else None,
        "projected_tokens": a.project_samples * a.seqlen,
        "projected_moe_layer_s": round(proj_layer, 1),
        "projected_moe_layer_min": round(proj_layer / 60, 2),
        "projected_glm52_hours": round((MOE_LAYERS * proj_layer + DENSE_LAYERS * dense) / 3600, 2),
        "wall_s": round(time.time() - t_start, 1),
    }
    log(f"measured MoE layer at {a.samples} x {a.seqlen} tokens: {measured:.1f} s; projected to "
        f"{a.project_samples} x {a.seqlen} tokens (token-proportional stages x {scale:g}): {proj_layer:.1f} s = "
        f"{proj_layer / 60:.2f} min per MoE layer (target <= 6 min); whole GLM-5.2 on one GPU ({MOE_LAYERS} MoE + "
        f"{DENSE_LAYERS} dense layers): {out['projected_glm52_hours']} h" + (f"; MISSING stages {missing}: the "
                                                                            "projection undercounts" if missing else ""))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

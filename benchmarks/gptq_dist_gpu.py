"""Time one rank's share of kq's GPTQ under torchrun on one GPU, for a full-size GLM-5.2 MoE layer
(generated weights), and project the whole GLM-5.2 run on N GPUs (default 8) from those times.

    python3 benchmarks/gptq_dist_gpu.py                        # H200: rank 0 of 8, 512 x 4096 tokens in all
    python3 benchmarks/gptq_dist_gpu.py --ranks 4 --expert-chunk 16
    python benchmarks/gptq_dist_gpu.py --tiny --device cpu     # dry run of every stage on tiny shapes

What one rank of an N-rank run does per MoE layer (kq.quantize.distributed, docs/distributed.md), and
how each stage is timed here (GPU synchronised; the same kq functions the run calls):
  load_own      read + dequantize the layer with only this rank's E/N experts        measured
  bcast_load    every other expert's weights from its owner                          estimated (--link-gbps)
  moe_inputs    this rank's windows through attention                                measured at its share
  bcast_x       every other rank's MoE inputs X (fp32), so each rank has all tokens  estimated
  routing       routing + the shared gate/up Hessian X^T X over all tokens (every
                rank computes it: policy all)                                        measured x token ratio
  hessians      this rank's expert chunks: down-projection inputs over all tokens    measured x token ratio
  solver        this rank's expert chunks: the GPTQ solver                           measured
  bcast_res     every other expert's codes (int8) and scales (bf16)                  estimated
  set_experts   all experts' dequantized INT4 weights into the layer                 measured
  propagate     this rank's windows through the whole layer                          measured at its share
  save_acts     this rank's part of the next layer's inputs (parallel on all ranks)  measured at its share
  save_results  this rank's experts' packed codes (parallel on all ranks)             measured
"measured at its share": run on ceil(P / N) windows, P = --project-samples (512 / 8 = 64 windows,
--samples, so no scaling); "x token ratio": measured on those windows' tokens, scaled by P / samples
(the cost is linear in tokens: one big matmul per expert). The broadcasts are not measured (one GPU):
bytes each rank receives / --link-gbps (NVLink, NCCL broadcast; an assumption, printed). Dense layers
(3 of GLM-5.2's 78) count as load_own + moe_inputs + propagate + save_acts (an upper bound).
save_acts assumes the disk takes N writers at once at one writer's rate (local NVMe per GPU or a
parallel file system); --disk-gbps caps the N writers' total (0: no cap).

Overlapped writes: the runner writes a layer's files (save_acts, save_results) on a background thread
while the next layer computes (kq.quantize.layerwise._LayerWriter), after host copies made on the main
thread. Measured here for real: after the stages above, host_copy makes this layer's host copies as the
runner does (lw._host_acts, lw._packed_tensors), the real writer gets them, and a second round of the
compute stages runs meanwhile (load_own, moe_inputs, own_chunks, set_experts, propagate: the same calls;
the routing-only call is round 1's way of splitting own_chunks and is not repeated, round 2 splits with
round 1's routing time); write_wait is the wait for the writer after that round.
  compute_round_s     round 1's sum of those five stages (no writes running)
  overlapped_round_s  round 2's wall time from handing the files over to the writer being done
  host_copy_s         the main thread's host copies (not overlapped)
Projected MoE layer with overlapped writes: the stages above with round 2's times in place of round 1's
(scaled the same way; the broadcasts the same estimates), no save_acts / save_results, plus
(host_copy + write_wait) x the own-windows ratio (like save_acts, which dominates both). The wait is
measured behind this run's compute, shorter than the projected one (routing and hessians x P / samples,
the broadcasts): an upper bound of what the writes add. With --disk-gbps, the writes' part is at least
the capped save_acts + save_results less the projected compute. Dense layers count their writes in full,
as before.
Prints each stage as it ends (stderr) and one JSON line (stdout): stages, per-layer and whole-model
projections in hours (sequential writes, as before, and overlapped), peak GPU memory, and the per-rank
memory estimate at the projected size.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kq.checkpoint.reader import CheckpointReader  # noqa: E402
from kq.model import LayerwiseModel  # noqa: E402
import kq.quantize.layerwise as lw  # noqa: E402
from kq.quantize.distributed import World, split  # noqa: E402

MOE_LAYERS, DENSE_LAYERS = 75, 3   # GLM-5.2: 78 decoder layers, the first 3 dense


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/kq-gptq-layer"), help="generated checkpoint (shared "
                    "with gptq_layer_gpu.py) and scratch files")
    ap.add_argument("--ranks", type=int, default=8, help="N: GPUs of the projected torchrun run")
    ap.add_argument("--project-samples", type=int, default=512, help="P: windows of --seqlen tokens in the run")
    ap.add_argument("--samples", type=int, default=None, help="windows run here (default ceil(P / N): one "
                    "rank's share)")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--expert-chunk", type=int, default=32, help="experts per batched solve (the unit split "
                    "across ranks)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--link-gbps", type=float, default=150.0, help="GB/s each rank receives in an NCCL "
                    "broadcast (assumed; H200 NVLink is 450 GB/s per direction)")
    ap.add_argument("--disk-gbps", type=float, default=0.0, help="cap on the N ranks' total write rate (0: none)")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="dry run on tiny shapes (CPU ok; projections meaningless)")
    a = ap.parse_args()
    t_start = time.time()
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    cuda = dev.type == "cuda"
    N, P = a.ranks, a.project_samples
    S = a.samples or math.ceil(P / N)

    def log(msg):
        print(f"[{time.time() - t_start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    t: dict = {}

    def phase(name, fn):
        log(f"{name} ...")
        sync()
        t0 = time.time()
        r = fn()
        sync()
        t[name] = round(time.time() - t0, 3)
        mem = f", peak GPU {torch.cuda.max_memory_allocated() / 1e9:.1f} GB" if cuda else ""
        log(f"{name}: {t[name]} s{mem}")
        return r

    log(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}; rank 0 of {N}: "
        f"{S} of {P} windows x {a.seqlen} tokens, group {a.group}, expert chunk {a.expert_chunk}, {a.dtype}")
    ckpt = a.work / ("tiny-one-layer" if a.tiny else "glm52-one-layer")
    if not (ckpt / "model.safetensors.index.json").exists():
        from kq.synth import generate, generate_layer_shapes
        t0 = time.time()
        if a.tiny:
            generate("glm5", ckpt, seed=0, num_layers=1, first_k_dense=0, mtp=False, overwrite=True)
        else:
            generate_layer_shapes("glm5", ckpt, seed=0, num_layers=1, overwrite=True)
        log(f"generated {ckpt} in {time.time() - t0:.1f} s")
    model = LayerwiseModel(CheckpointReader(ckpt), dtype=getattr(torch, a.dtype), device=dev)
    cfg = lw.GptqConfig(group=a.group, policy="all", damp=a.damp, expert_chunk=a.expert_chunk, batch=1)
    E = model.n_experts()
    rank0 = World(0, N)
    own_experts = split(E, rank0)
    chunks_total = lw.n_chunks(E, cfg)
    own_chunks = split(chunks_total, rank0)
    ids = torch.randint(0, model.config.vocab_size, (S, a.seqlen), generator=torch.Generator().manual_seed(0))
    hidden = [model.embed(c) for c in ids.split(1)]
    carry: list = [None] * len(hidden)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    solver = {"s": 0.0}
    inner = lw.gptq_quantize

    def timed_solver(*args, **kw):
        sync()
        t0 = time.time()
        r = inner(*args, **kw)
        sync()
        solver["s"] += time.time() - t0
        return r

    def compute_round(r: str):
        """One layer's compute stages, timed as `<stage><r>`; round 1 (r "") also times routing alone.
        -> (the layer, this rank's expert results)."""
        layer = phase("load_own" + r, lambda: model.load_layer(0, experts=own_experts))
        ex = layer.mlp.experts
        for e in range(E):   # the experts other ranks would send: copies of this rank's (realistic values)
            if e not in own_experts:
                ex.gate_up_proj.data[e] = ex.gate_up_proj.data[own_experts[e % len(own_experts)]]
                ex.down_proj.data[e] = ex.down_proj.data[own_experts[e % len(own_experts)]]
        X = phase("moe_inputs" + r, lambda: lw._moe_inputs(model, layer, hidden, carry))
        solver["s"] = 0.0
        lw.gptq_quantize = timed_solver
        try:
            if not r:
                phase("routing", lambda: lw.quantize_experts(layer, X, cfg, chunks=[]))
            res, _ = phase("own_chunks" + r, lambda: lw.quantize_experts(layer, X, cfg, chunks=own_chunks))
        finally:
            lw.gptq_quantize = inner
        del X
        t["solver" + r] = round(solver["s"], 3)
        t["hessians" + r] = round(max(t["own_chunks" + r] - t["routing"] - t["solver" + r], 0.0), 3)
        keys = sorted(res)
        # what every rank holds after bcast_res
        res_all = {e: tuple(x.clone() for x in res[keys[e % len(keys)]]) for e in range(E)}
        phase("set_experts" + r, lambda: lw._set_experts(layer, res_all, cfg.group))
        phase("propagate" + r, lambda: lw._propagate(model, layer, hidden, carry))
        return layer, res

    layer, res = compute_round("")
    inter = layer.mlp.experts.down_proj.shape[-1]
    del layer
    a.work.mkdir(parents=True, exist_ok=True)
    acts_file, results_file = a.work / "acts-0001.rank0.safetensors", a.work / "layer-0000.rank0.safetensors"
    phase("save_acts", lambda: lw._save_acts(acts_file, hidden, carry))
    phase("save_results", lambda: lw._atomic_save(lw._packed_tensors(model.layer_prefix(0), res), results_file))
    compute_stages = ("load_own", "moe_inputs", "own_chunks", "set_experts", "propagate")
    t["compute_round"] = round(sum(t[k] for k in compute_stages), 3)

    # Round 2: this layer's files written by the runner's writer while the next layer's compute runs.
    files = phase("host_copy", lambda: {acts_file: lw._host_acts(hidden, carry),
                                        results_file: lw._packed_tensors(model.layer_prefix(0), res)})
    del res
    with lw._LayerWriter() as writer:
        sync()
        t0 = time.time()
        writer.submit(files)
        del files
        compute_round("_2")
        phase("write_wait", writer.wait)
        t["overlapped_round"] = round(time.time() - t0, 3)
    log(f"overlapped round {t['overlapped_round']} s vs compute alone {t['compute_round']} s "
        f"(+ host copies {t['host_copy']} s)")
    acts_bytes = sum(h.numel() * h.element_size() for h in hidden) + sum(
        c.numel() * c.element_size() for c in carry if c is not None)
    for f in (acts_file, results_file):
        f.unlink(missing_ok=True)

    # -- projection ----------------------------------------------------------------------------
    tok_ratio = P / S                          # all tokens of the run / tokens measured here
    own_ratio = math.ceil(P / N) / S           # this rank's windows / windows measured here
    H = model.config.hidden_size
    T_all = P * a.seqlen
    elt = torch.empty((), dtype=model.dtype).element_size()
    recv = (N - 1) / N
    bytes_load = E * 3 * inter * H * elt * recv
    bytes_x = T_all * H * 4 * recv
    bytes_res = E * 3 * inter * H * (1 + 2 / a.group) * recv
    link = a.link_gbps * 1e9
    save_acts = t["save_acts"] * own_ratio
    if a.disk_gbps:
        save_acts = max(save_acts, acts_bytes * own_ratio * N / (a.disk_gbps * 1e9))
    stages = {
        "load_own": t["load_own"], "bcast_load": bytes_load / link,
        "moe_inputs": t["moe_inputs"] * own_ratio, "bcast_x": bytes_x / link,
        "routing": t["routing"] * tok_ratio, "hessians": t["hessians"] * tok_ratio, "solver": t["solver"],
        "bcast_res": bytes_res / link, "set_experts": t["set_experts"],
        "propagate": t["propagate"] * own_ratio, "save_acts": save_acts, "save_results": t["save_results"],
    }
    moe_layer = sum(stages.values())
    dense = t["load_own"] + stages["moe_inputs"] + stages["propagate"] + stages["save_acts"]
    hours = (MOE_LAYERS * moe_layer + DENSE_LAYERS * dense) / 3600
    # Overlapped writes (docstring): round 2's stages, scaled as above, and what the writes add to them.
    over = {k: v for k, v in stages.items() if k not in ("save_acts", "save_results")} | {
        "load_own": t["load_own_2"], "moe_inputs": t["moe_inputs_2"] * own_ratio,
        "hessians": t["hessians_2"] * tok_ratio, "solver": t["solver_2"], "set_experts": t["set_experts_2"],
        "propagate": t["propagate_2"] * own_ratio}
    writes = t["write_wait"] * own_ratio
    if a.disk_gbps:
        writes = max(writes, stages["save_acts"] + stages["save_results"] - sum(over.values()))
    over |= {"host_copy": t["host_copy"] * own_ratio, "writes_not_overlapped": writes}
    moe_layer_over = sum(over.values())
    hours_over = (MOE_LAYERS * moe_layer_over + DENSE_LAYERS * dense) / 3600
    # Per-rank memory at the projected size: all tokens' X (fp32) + one expert's gate/up outputs on all
    # tokens (fp32) + this rank's windows' hidden states + the layer + one chunk's Hessians (fp32).
    mem = {"X_all_tokens_gb": T_all * H * 4 / 1e9, "expert_activations_gb": T_all * 2 * inter * 4 / 1e9,
           "own_hidden_gb": acts_bytes * own_ratio / 1e9, "layer_gb": E * 3 * inter * H * elt / 1e9,
           "chunk_hessians_gb": a.expert_chunk * H * H * 4 / 1e9}
    out = {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "shapes": "tiny (dry run)" if a.tiny else "GLM-5.2 full layer (hidden 6144, 256 experts x 2048)",
        "ranks": N, "project_tokens": f"{P} x {a.seqlen}", "measured_windows": S, "group": a.group,
        "expert_chunk": a.expert_chunk, "own_chunks": len(own_chunks), "chunks": chunks_total, "dtype": a.dtype,
        "link_gbps_assumed": a.link_gbps, "disk_gbps_cap": a.disk_gbps or None,
        "measured_s": t, "projected_stage_s": {k: round(v, 2) for k, v in stages.items()},
        "projected_moe_layer_s": round(moe_layer, 1), "projected_dense_layer_s": round(dense, 1),
        "projected_glm52_hours": round(hours, 2),
        "compute_round_s": t["compute_round"], "overlapped_round_s": t["overlapped_round"],
        "host_copy_s": t["host_copy"], "write_wait_s": t["write_wait"],
        "projected_overlapped_stage_s": {k: round(v, 2) for k, v in over.items()},
        "projected_moe_layer_overlapped_s": round(moe_layer_over, 1),
        "projected_glm52_hours_overlapped": round(hours_over, 2), "target_hours": 1.0,
        "per_rank_memory_gb": {k: round(v, 1) for k, v in mem.items()} | {"sum": round(sum(mem.values()), 1)},
        "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1) if cuda else None,
        "wall_s": round(time.time() - t_start, 1),
    }
    for k, v in stages.items():
        log(f"  {k:13s} {v:8.2f} s per MoE layer")
    log(f"projected on {N} GPUs at {P} x {a.seqlen} tokens: {moe_layer:.1f} s per MoE layer; GLM-5.2 "
        f"({MOE_LAYERS} MoE + {DENSE_LAYERS} dense layers): {hours:.2f} h (target <= 1 h)")
    log(f"with the writes overlapped (host copies {over['host_copy']:.2f} s, writes beyond the compute "
        f"{over['writes_not_overlapped']:.2f} s): {moe_layer_over:.1f} s per MoE layer; GLM-5.2: {hours_over:.2f} h")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

"""GPU check of kq's SGLang plugin (issue 5, point 5). Run by hand on an H200; not a pytest file.

On the GPU machine (no internet; wheels as in shared/tools/README.md, installed with
`pip install --no-index --no-deps --target /tmp/site ...`, plus sgl_kernel/scalar_type.py):

    PYTHONPATH=/tmp/site:<repo>:<shared>/tools/stubs:<folder with sgl_kernel/> \\
        python3 tests/sglang/gpu_check.py [--full] [--tokens 1,16,64] [--out DIR]

What it does, for the trained tiny model (../shared/models/tiny-glm-5.2-fp8) and, with --full, one
generated full-size GLM-5.2 MoE layer (256 experts, hidden 6144, I 2048):
1. `kq quantize` (group 128 for full size, 32 for the tiny model) and `kq shard --tp 8`;
2. for TP ranks 0 and 7 of 8: builds SGLang's own `FusedMoE` layer twice from the same
   checkpoint tensors through SGLang's own weight loader — once with kq's plugin config (kq's
   MoE method, kq's Triton kernels) and once with SGLang's `CompressedTensorsConfig` (its
   `CompressedTensorsWNA16MoE`, the Marlin MoE, incl. its repack) — and runs both layers'
   `quant_method.apply` on the same tokens and routing with the model's routed_scaling_factor;
   compares them with kq's torch reference; times both (CUDA graph replay);
3. times one rank's expert load: `kq shard` rank file vs reading the unsharded checkpoint's
   expert tensors and slicing them as SGLang's loader does, each with the page cache dropped for
   those files first (posix_fadvise DONTNEED; "warm" when the kernel keeps them anyway).
Prints a table; writes OUT/gpu_check.json. Anything that fails is reported, not hidden.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
TINY = REPO.parent / "shared" / "models" / "tiny-glm-5.2-fp8"
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def kq_cli(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "kq", *map(str, args)], capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError(f"kq {' '.join(map(str, args))}: {r.stderr[-2000:]}")
    return r


def prepare(work: Path, full: bool) -> tuple[Path, int]:
    if full:
        from kq.synth import generate_layer_shapes
        src = work / "glm52-full-src"
        if not src.exists():
            generate_layer_shapes("glm5", src, num_layers=2, mtp=False)  # layer 0 dense, layer 1 MoE
        group = 128
    else:
        src, group = TINY, 32
    out = work / (src.name + f"-int4-g{group}")
    if not (out / "kq-manifest.json").exists():
        kq_cli("quantize", src, "--out", out, "--group-size", group, "--device", "auto")
    kq_cli("shard", out, "--tp", 8)
    return out, group


def publish(folder: Path):
    from sglang.srt.runtime_context import publish as pub
    from sglang.srt.server_args import ServerArgs
    # device="cpu" only steers argument resolution; layers are built on the GPU below.
    pub(ServerArgs(model_path=str(folder), tp_size=8, device="cpu"), role="scheduler")


def build_layer(qc, cfg, prefix, rank):
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.runtime_context import get_parallel
    with get_parallel().override(moe_tp_size=8, moe_tp_rank=rank, moe_ep_size=1, moe_ep_rank=0), torch.device(DEV):
        return FusedMoE(num_experts=cfg["n_routed_experts"], hidden_size=cfg["hidden_size"],
                        intermediate_size=cfg["moe_intermediate_size"], layer_id=1,
                        top_k=cfg["num_experts_per_tok"], params_dtype=torch.bfloat16, quant_config=qc,
                        prefix=prefix, routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))


def load_layer(layer, reader, prefix, n_experts, process=True):
    """SGLang's DeepSeek/GLM load_weights for routed experts, through FusedMoE.weight_loader."""
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    params = dict(layer.named_parameters())
    for pname, wname, e, shard in FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", n_experts):
        for suffix in ("weight_packed", "weight_scale", "weight_shape"):
            p = params.get(pname[len("experts."):] + suffix)
            if p is None:
                continue
            t = reader.raw(f"{prefix}.{wname[len('experts.'):]}{suffix}")
            p.weight_loader(p, t.to(DEV), pname + suffix, shard_id=shard, expert_id=e)
    if process:
        layer.quant_method.process_weights_after_loading(layer)


def time_graph(fn, reps=20):
    if DEV != "cuda":
        t = time.perf_counter(); fn(); return (time.perf_counter() - t) * 1e6
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    return sorted(ts)[len(ts) // 2]


def moe_rows(folder: Path, group: int, tokens: list[int]) -> list[dict]:
    from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from kq.checkpoint.reader import CheckpointReader
    from kq.kernels import reference
    from kq.sglang.config import KqConfig

    cfg = json.loads((folder / "config.json").read_text())
    qcd = cfg["quantization_config"]
    reader = CheckpointReader(folder)
    prefix = "model.layers.1.mlp.experts"
    E, H, k = cfg["n_routed_experts"], cfg["hidden_size"], cfg["num_experts_per_tok"]
    rows = []
    for rank in (0, 7):
        row = {"model": folder.name, "rank": rank}
        kq_layer = build_layer(KqConfig.from_config(qcd), cfg, prefix, rank)
        load_layer(kq_layer, reader, prefix, E, process=False)
        raw = {n: getattr(kq_layer, n).data.clone() for n in
               ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale")}
        kq_layer.quant_method.process_weights_after_loading(kq_layer)
        row["kq_method"] = type(kq_layer.quant_method).__name__
        try:
            m_layer = build_layer(CompressedTensorsConfig.from_config(qcd), cfg, prefix, rank)
            load_layer(m_layer, reader, prefix, E)
            row["marlin_method"] = type(m_layer.scheme).__name__
        except Exception as e:
            m_layer = None
            row["marlin_error"] = f"{type(e).__name__}: {e}"[:300]
            traceback.print_exc()
        for T in tokens:
            g = torch.Generator(device="cpu").manual_seed(T)
            x = (torch.randn(T, H, generator=g) * 0.5).to(torch.bfloat16).to(DEV)
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32).to(DEV)
            w = torch.rand(T, k, generator=g).to(DEV)
            disp = StandardDispatchOutput(hidden_states=x, hidden_states_scale=None,
                                          topk_output=StandardTopKOutput(w, ids, torch.zeros(T, E, device=DEV)))
            ref = reference.fused_moe_w4a16(x, kq_layer.kq_moe, w, ids,
                                            routed_scaling_factor=kq_layer.moe_runner_config.routed_scaling_factor or 1.0).float()
            out_kq = kq_layer.quant_method.apply(kq_layer, disp).hidden_states.float()
            r = {**row, "tokens": T, "ref_max": float(ref.abs().max()),
                 "kq_vs_ref_rel": float((out_kq - ref).norm() / ref.norm()),
                 "kq_us": time_graph(lambda: kq_layer.quant_method.apply(kq_layer, disp))}
            rsf = kq_layer.moe_runner_config.routed_scaling_factor or 1.0
            out_m = None
            if m_layer is not None:
                try:
                    out_m = m_layer.quant_method.apply(m_layer, disp).hidden_states.float()
                    r["marlin_path"] = "SGLang FusedMoE + CompressedTensorsWNA16MoE.apply (fused_marlin_moe)"
                    r["marlin_us"] = time_graph(lambda: m_layer.quant_method.apply(m_layer, disp))
                except Exception as e:
                    r["marlin_error"] = f"{type(e).__name__}: {e}"[:300]
                    traceback.print_exc()
            if out_m is None and DEV == "cuda":
                # fused_marlin_moe imports sgl_kernel (moe_sum_reduce), absent from the offline GPU
                # machine: drive SGLang's JIT Marlin GEMM directly, as shared/tools/peer_moe_bench.py does.
                try:
                    fn, us = marlin_manual(raw, x, w, ids, E, group, rsf)
                    out_m = fn().float()
                    r["marlin_path"] = "moe_wna16_marlin_gemm x2 + torch SiLU/sum (peer_moe_bench style)"
                    r["marlin_us"] = us
                except Exception as e:
                    r["marlin_manual_error"] = f"{type(e).__name__}: {e}"[:300]
                    traceback.print_exc()
            if out_m is not None:
                r["marlin_vs_ref_rel"] = float((out_m - ref).norm() / ref.norm())
                r["kq_vs_marlin_rel"] = float((out_kq - out_m).norm() / out_m.norm())
            rows.append(r)
    reader.close()
    return rows


def marlin_manual(raw, x, w, ids, E, group, rsf):
    """SGLang's Marlin MoE GEMM (JIT `moe_wna16_marlin_gemm`) on the same rank's weights, two
    stages with torch SiLU*up and the weighted top-k sum between/after. Returns (fn, us); the
    time excludes routing alignment (done in torch, as in peer_moe_bench) and uses events, not
    a CUDA graph."""
    sys.path.insert(0, str(REPO.parent / "shared" / "tools"))
    import peer_moe_bench as pb

    T, k = ids.shape
    # int32 words viewed as bytes: byte b of word j holds columns 8j+2b (low nibble), 8j+2b+1.
    B13 = raw["w13_weight_packed"].contiguous().view(torch.uint8)
    B2 = raw["w2_weight_packed"].contiguous().view(torch.uint8)
    W13, S13 = pb.marlin_prepare(B13, raw["w13_weight_scale"], group)
    W2, S2 = pb.marlin_prepare(B2, raw["w2_weight_scale"], group)
    N13, K13, N2, K2 = B13.shape[1], B13.shape[2] * 2, B2.shape[1], B2.shape[2] * 2
    ws = torch.zeros(torch.cuda.get_device_properties(0).multi_processor_count * 4, dtype=torch.int32, device=DEV)
    bm = next((c for c in (8, 16, 32, 48, 64) if T * k / E / c < 0.9), 64)
    ids2, w2 = ids.reshape(-1, 1).contiguous(), w.reshape(-1, 1).contiguous()
    al1, al2 = pb.align(ids, bm, E), pb.align(ids2, bm, E)

    def fn():
        c1 = torch.zeros(T * k, N13, device=DEV, dtype=torch.bfloat16)
        pb.run_marlin(x, W13, S13, c1, w, ids, al1, bm, N13, K13, ws)
        i = N13 // 2
        h = (torch.nn.functional.silu(c1[:, :i].float()) * c1[:, i:].float()).to(torch.bfloat16)
        c2 = torch.zeros(T * k, N2, device=DEV, dtype=torch.bfloat16)
        pb.run_marlin(h, W2, S2, c2, w2, ids2, al2, bm, N2, K2, ws)
        return ((c2.float().view(T, k, N2) * w[..., None]).sum(1) * rsf).to(torch.bfloat16)

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        fn()
    b.record()
    torch.cuda.synchronize()
    return fn, a.elapsed_time(b) / 20 * 1000


def _drop_cache(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load_rows(folder: Path, group: int) -> list[dict]:
    """One rank's routed experts onto the GPU: kq shard file vs the unsharded checkpoint."""
    from safetensors import safe_open
    from kq.checkpoint.rank_shards import cut_rank, expert_layers, rank_file, read_rank, shard_dir
    from kq.checkpoint.reader import CheckpointReader

    d = shard_dir(folder, 8, 1)
    mf = json.loads((d / "manifest.json").read_text())
    rows = []
    for rank in (0, 7):
        f = d / rank_file(rank, 0)
        _drop_cache([f])
        t = time.perf_counter()
        for layer, meta in mf["layers"].items():
            pp = read_rank(f, layer, meta, 8, 1, group, device=DEV)
        torch.cuda.synchronize() if DEV == "cuda" else None
        t_shard = time.perf_counter() - t
        shards = sorted(str(p) for p in folder.glob("model-*.safetensors"))
        _drop_cache(shards)
        t = time.perf_counter()
        reader = CheckpointReader(folder)
        for ly in expert_layers(reader):
            # What the plugin does without rank files: SGLang reads every expert tensor, keeps
            # this rank's slice, kq prepacks on the GPU.
            pp = cut_rank(_OnDevice(reader), ly, 8, 1, rank, 0, group)
        torch.cuda.synchronize() if DEV == "cuda" else None
        t_full = time.perf_counter() - t
        reader.close()
        rows.append({"model": folder.name, "rank": rank, "rank_file_bytes": f.stat().st_size,
                     "checkpoint_bytes": sum(os.path.getsize(s) for s in shards),
                     "shard_load_s": round(t_shard, 4), "unsharded_load_s": round(t_full, 4),
                     "speedup": round(t_full / t_shard, 2)})
        del pp
    return rows


class _OnDevice:
    """CheckpointReader whose tensors land on the GPU (the full tensor is read, as SGLang does)."""
    def __init__(self, reader):
        self.r = reader

    def raw(self, name):
        return self.r.raw(name).to(DEV)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="also one generated full-size GLM-5.2 MoE layer")
    ap.add_argument("--tokens", default="1,16,64")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", default="/tmp/kq-gpu-check")
    args = ap.parse_args()
    import logging, warnings
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    work = Path(args.work); work.mkdir(parents=True, exist_ok=True)
    if DEV == "cpu":  # dry run of this script on a CPU machine: kq's torch reference, no Marlin
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    from sglang.srt.plugins import load_plugins
    load_plugins()
    res = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
           "moe": [], "load": [], "errors": []}
    for full in ([False, True] if args.full else [False]):
        try:
            folder, group = prepare(work, full)
            publish(folder)
            res["moe"] += moe_rows(folder, group, [int(t) for t in args.tokens.split(",")])
            res["load"] += load_rows(folder, group)
        except Exception as e:
            traceback.print_exc()
            res["errors"].append(f"{'full' if full else 'tiny'}: {type(e).__name__}: {e}"[:500])
    Path(args.out, "gpu_check.json").write_text(json.dumps(res, indent=1))
    print(f"{res['device']}  torch {res['torch']}")
    print(f"{'model':32} {'rank':>4} {'T':>3} {'kq/ref rel':>10} {'marlin/ref':>10} {'kq/marlin':>10} {'kq us':>8} {'marlin us':>9}")
    for r in res["moe"]:
        f = lambda k, fmt: (fmt % r[k]) if k in r else "-"
        print(f"{r['model'][:32]:32} {r['rank']:>4} {r['tokens']:>3} {f('kq_vs_ref_rel', '%.2e'):>10} "
              f"{f('marlin_vs_ref_rel', '%.2e'):>10} {f('kq_vs_marlin_rel', '%.2e'):>10} {f('kq_us', '%.1f'):>8} "
              f"{f('marlin_us', '%.1f'):>9}")
    print(f"{'model':32} {'rank':>4} {'rank file MB':>12} {'shard load s':>12} {'unsharded s':>11} {'speedup':>7}")
    for r in res["load"]:
        print(f"{r['model'][:32]:32} {r['rank']:>4} {r['rank_file_bytes'] / 1e6:>12.1f} {r['shard_load_s']:>12} "
              f"{r['unsharded_load_s']:>11} {r['speedup']:>7}")
    paths = sorted({r["marlin_path"] for r in res["moe"] if "marlin_path" in r})
    for p in paths:
        print("marlin path:", p)
    for e in res["errors"] + sorted({r[k] for r in res["moe"] for k in ("marlin_error", "marlin_manual_error") if k in r}):
        print("ERROR", e)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

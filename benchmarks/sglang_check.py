"""kq's SGLang plugin against SGLang's own Marlin MoE, and per-rank loading (`python -m benchmarks sglang`;
on an H200 through benchmarks/gpu_sglang.sh).

    PYTHONPATH=/tmp/site:$PWD/.gpu/stubs:$PWD python3 benchmarks/sglang_check.py [--full] [--tokens 1,16,64] [--out DIR]
    python3 benchmarks/sglang_check.py --warm-marlin      # compile SGLang's JIT Marlin MoE path, exit
    <side venv python> benchmarks/sglang_check.py --cpu-dry  # this script on a CPU (see below)

Models: the trained tiny model (../shared/models/tiny-glm-5.2-fp8) when it is there, else a
generated tiny GLM-5.2-layout checkpoint (kq.synth, hidden 256, 16 experts of I 1024, top-4,
routed_scaling_factor 2.5); with --full also one generated full-size GLM-5.2 MoE layer (256
experts, hidden 6144, I 2048, top-8, rsf 2.5). The output names the one used ("source").
The generated tiny one has I 1024 because SGLang's Marlin MoE needs, per TP-8 rank, K % 64 and
N % 128 on both GEMMs (I/8 = 128); the trained tiny model (I 256 -> 32 per rank) cannot go
through Marlin at TP 8 (that error is then reported, the kq rows still run).

Steps, per model:
1. `kq quantize` (group 128 for full size, 32 for tiny) and `kq shard --tp 8`;
2. for TP ranks 0 and 7 of 8: SGLang's own `FusedMoE` layer built twice (check_plugin's
   _build_layer: the rank is set through SGLang's runtime_context parallel override, as the CPU
   tests do) and filled through SGLang's own `FusedMoE.weight_loader` (check_plugin's _load,
   DeepSeek/GLM load_weights naming) from the same checkpoint tensors: once with kq's plugin
   config (KqMoEMethod; it takes the `kq shard` rank file when present, and the check asserts
   that equals kq's prepack of the tensors SGLang's loader put on the rank), once with SGLang's
   `CompressedTensorsConfig` (CompressedTensorsWNA16MoE: Marlin repack + fused_marlin_moe).
   Before the repack, both layers' loaded tensors must be the same rank slice (Marlin's are
   stored transposed). Both layers' `quant_method.apply` run on the same tokens and routing with
   the model's routed_scaling_factor (2.5) set on the layer, as SGLang's DeepSeek/GLM MoE does
   on CUDA: the model does not multiply the routed output by it, the MoE method must (Marlin in
   moe_sum_reduce, kq in its combine kernel). Reference: kq's torch reference (fp32 dequant +
   matmul) on the rank's prepacked weights, rsf applied once.
   Tolerances (relative Frobenius error of the [T, H] output): 2e-2 for kq-vs-ref,
   marlin-vs-ref and kq-vs-marlin. Both kernels take bf16 activations, accumulate in fp32, round
   the SiLU*up intermediate and the output to bf16 (unit roundoff 2^-8 = 3.9e-3): a few 1e-3 is
   expected; 2e-2 leaves margin, while any real fault is far above it: rsf missed or applied
   twice gives 0.6 or 1.5, a wrong group/scale/expert or TP slice gives ~1. An extra column
   shows the Marlin error against the reference with rsf left out, to show the check sees it.
   Timing: CUDA graph replay of 8 apply() calls with 8 different routings (so the touched experts
   exceed the 60 MB L2 at full size), median of 20 replays, per call.
   SGLang's fused_marlin_moe imports sgl_kernel.moe_sum_reduce (the 535 MB sgl_kernel wheel does
   not travel; .gpu/stubs holds only its scalar_type.py): a torch stand-in (sum over top-k times
   rsf, fp32) is put in the stub module; everything else in that path is SGLang's (JIT Marlin
   GEMMs, JIT align/activation kernels). If that path still fails, a manual two-GEMM Marlin
   path (shared/tools/peer_moe_bench.py style, copied to .gpu/) is tried and named in the output.
3. one rank's expert load onto the GPU: the `kq shard` rank file (read and prepacked) vs reading
   the unsharded checkpoint's expert tensors, slicing the rank's part and prepacking (what the plugin
   does without rank files), each after fdatasync + posix_fadvise(DONTNEED) on the files read (pages
   the kernel keeps anyway would make that run warmer; not measured here).

--cpu-dry (in the SGLang side venv, no GPU): steps 1-2 with everything that needs CUDA left out
(kq's Triton kernels -> its torch path, Marlin repack/GEMMs, CUDA graphs), so a first GPU run
does not die on an import, an SGLang API name or a shape: both layers are built and loaded
through SGLang's loader, compared slice for slice, and kq's apply runs; step 3 runs on CPU.

Prints a table; writes OUT/gpu_check.json. Anything that fails is reported, not hidden; the exit
status is 1 when a step errored or a check is outside its tolerance.
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

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "tests" / "sglang"      # check_plugin's layer builder and loader, shared with the CPU tests
TINY = REPO.parent / "shared" / "models" / "tiny-glm-5.2-fp8"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TP = 8
RANKS = (0, 7)
TOL = 2e-2
ROUTINGS = 8
sys.path.insert(0, str(HERE))


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def kq_cli(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "kq", *map(str, args)], capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError(f"kq {' '.join(map(str, args))}: {r.stderr[-2000:]}")
    log(f"kq {args[0]} {Path(str(args[1])).name}: {time.perf_counter() - t:.1f} s")
    return r


def prepare(work: Path, full: bool, tiny: str = "auto") -> tuple[Path, int, str]:
    """(kq checkpoint folder, group, description of the source)."""
    t = time.perf_counter()
    if full:
        from kq.synth import generate_layer_shapes
        src = work / "glm52-full-src"
        if not (src / "config.json").exists():
            generate_layer_shapes("glm5", src, num_layers=1)  # one MoE layer (layer 0)
        group, what = 128, "generated full-size GLM-5.2 layer (kq.synth size=full, 1 MoE layer)"
    elif TINY.is_dir() and tiny != "generated":
        src, group, what = TINY, 32, f"trained tiny model {TINY}"
    else:
        from kq.synth import generate
        src = work / "tiny-glm52-gen-src"
        if not (src / "config.json").exists():
            generate("glm5", src, seed=0, num_layers=2, mtp=False, moe_intermediate=1024)
        group, what = 32, "generated tiny GLM-5.2 layout (kq.synth glm5, hidden 256, 16 experts, I 1024; " \
                          "trained tiny model not on this machine)"
    log(f"source {src.name}: {time.perf_counter() - t:.1f} s")
    out = work / (src.name + f"-int4-g{group}")
    if not (out / "kq-manifest.json").exists():
        kq_cli("quantize", src, "--out", out, "--group-size", group, "--device", "auto")
    if not (out / "kq-shards" / f"tp{TP}-ep1" / "manifest.json").exists():
        kq_cli("shard", out, "--tp", TP)
    return out, group, what


def publish(folder: Path):
    from sglang.srt.runtime_context import publish as pub
    from sglang.srt.server_args import ServerArgs
    # device="cpu" only steers argument resolution (no GPU probing at parse time); the layers
    # are built on DEV below. rank_loader reads model_path from here.
    pub(ServerArgs(model_path=str(folder), tp_size=TP, device="cpu"), role="scheduler")


class LazyTensors:
    """check_plugin._load's `tensors`: this layer's expert tensors, read one at a time onto DEV."""
    def __init__(self, reader, prefix):
        self.reader, self.prefix = reader, prefix
        self.names = [n for n in reader.names() if n.startswith(prefix + ".") and ".weight_" in n]

    def items(self):
        for n in self.names:
            yield n, self.reader.raw(n).to(DEV)


def shim_moe_sum_reduce():
    """sgl_kernel.moe_sum_reduce: the real op, or the torch stand-in of the stub package
    (tests/sglang/stubs/sgl_kernel), installed here when the stub lacks it. Returns what ran."""
    import sgl_kernel
    f = getattr(sgl_kernel, "moe_sum_reduce", None)
    if f is not None and not getattr(f, "_kq_placeholder", False):
        if getattr(f, "_kq_stand_in", False):
            return "torch stand-in for sgl_kernel.moe_sum_reduce (sum over top-k x rsf, fp32; stub package)"
        return "sgl_kernel.moe_sum_reduce (real)"

    def moe_sum_reduce(x, out, routed_scaling_factor):
        out.copy_((x.float().sum(1) * float(routed_scaling_factor)).to(out.dtype))

    sgl_kernel.moe_sum_reduce = moe_sum_reduce
    return "torch stand-in for sgl_kernel.moe_sum_reduce (sum over top-k x rsf, fp32)"


def time_graph(fns, reps=20):
    """us per call: one CUDA graph holding every fn once (distinct routings), median replay."""
    def all_():
        for f in fns:
            f()
    if DEV != "cuda":
        t = time.perf_counter(); all_(); return (time.perf_counter() - t) * 1e6 / len(fns), "cpu-eager"
    for _ in range(2):
        all_()
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            all_()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            all_()
        run, how = g.replay, "graph"
    except Exception as e:
        log(f"CUDA graph capture failed ({type(e).__name__}: {str(e)[:200]}); timing eagerly")
        torch.cuda.synchronize()
        run, how = all_, "eager"
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); run(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / len(fns))
    return sorted(ts)[len(ts) // 2], how


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def moe_rows(folder: Path, group: int, tokens: list[int], dry: bool, marlin_ok: bool) -> tuple[list[dict], list[dict]]:
    from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    from check_plugin import _build_layer, _load
    from kq.sglang.rank_shards import expert_layers
    from kq.checkpoint.reader import CheckpointReader
    from kq.kernels import prepack_moe, reference
    from kq.sglang.config import KqConfig

    cfg = json.loads((folder / "config.json").read_text())
    qcd = cfg["quantization_config"]
    reader = CheckpointReader(folder)
    prefix = expert_layers(reader)[0].name  # first routed-expert layer of the checkpoint
    E, H, I, k = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    rsf = float(cfg.get("routed_scaling_factor") or 1.0)
    rows, ranks = [], []
    for rank in RANKS:
        t0 = time.perf_counter()
        row = {"model": folder.name, "layer": prefix, "rank": rank, "rsf": rsf}
        info = {**row}
        kq_layer = _build_layer(KqConfig.from_config(qcd), prefix, E, H, I, TP, 1, rank, 0, rsf, top_k=k, device=DEV)
        _load(kq_layer, LazyTensors(reader, prefix), prefix, E)
        raw = {n: getattr(kq_layer, n).data.clone() for n in
               ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale")}
        kq_layer.quant_method.process_weights_after_loading(kq_layer)
        info["kq_method"] = type(kq_layer.quant_method).__name__
        info["kq_used_rank_file"] = kq_layer.kq_rank_files is not None
        # in the layout the plugin chose (kq.kernels.moe_lane_layout: the lane layout on Hopper)
        mine = prepack_moe(raw["w13_weight_packed"], raw["w13_weight_scale"], raw["w2_weight_packed"],
                           raw["w2_weight_scale"], group, lane=kq_layer.kq_moe.lane)
        info["kq_weights_equal_prepack_of_loaded"] = all(
            torch.equal(getattr(mine, a), getattr(kq_layer.kq_moe, a)) for a in ("w13_q", "w13_s", "w2_q", "w2_s"))
        del mine
        info["kq_rank_shapes"] = {"w13": list(raw["w13_weight_packed"].shape), "w2": list(raw["w2_weight_packed"].shape)}
        m_layer = None
        try:
            m_layer = _build_layer(CompressedTensorsConfig.from_config(qcd), prefix, E, H, I, TP, 1, rank, 0, rsf,
                                   top_k=k, device=DEV)
            info["marlin_method"] = f"{type(m_layer.quant_method).__name__}/{type(m_layer.scheme).__name__}"
            _load(m_layer, LazyTensors(reader, prefix), prefix, E)
            # Same rank slice in both layers (SGLang stores the WNA16 scheme's tensors transposed).
            info["same_rank_slice_as_marlin_layer"] = all(
                torch.equal(getattr(m_layer, n).data, raw[n].transpose(1, 2)) for n in raw)
            if marlin_ok:
                m_layer.quant_method.process_weights_after_loading(m_layer)  # Marlin repack (JIT)
            else:  # --cpu-dry / --no-marlin: no Marlin kernel (not even its JIT repack) is touched
                m_layer = None
        except Exception as e:
            m_layer = None
            info["marlin_error"] = f"{type(e).__name__}: {e}"[:400]
            traceback.print_exc()
        info["setup_s"] = round(time.perf_counter() - t0, 2)
        ranks.append(info)
        log(f"rank {rank}: {json.dumps(info)}")
        for T in tokens:
            g = torch.Generator(device="cpu").manual_seed(1000 + T)
            x = (torch.randn(T, H, generator=g) * 0.5).to(torch.bfloat16).to(DEV)
            disps = []
            for _ in range(ROUTINGS if not dry else 1):
                ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32).to(DEV)
                w = torch.rand(T, k, generator=g).to(DEV)
                w = w / w.sum(-1, keepdim=True)  # DeepSeek/GLM renormalize the top-k weights
                disps.append(StandardDispatchOutput(hidden_states=x, hidden_states_scale=None,
                                                    topk_output=StandardTopKOutput(w, ids, torch.zeros(T, E, device=DEV))))
            d0 = disps[0]
            w0, ids0 = d0.topk_output.topk_weights, d0.topk_output.topk_ids
            ref = reference.fused_moe_w4a16(x, kq_layer.kq_moe, w0, ids0, routed_scaling_factor=rsf).float()
            out_kq = kq_layer.quant_method.apply(kq_layer, d0).hidden_states.float()
            r = {**row, "tokens": T, "ref_max": float(ref.abs().max()), "kq_vs_ref_rel": rel(out_kq, ref)}
            r["kq_us"], r["kq_timing"] = time_graph([lambda d=d: kq_layer.quant_method.apply(kq_layer, d) for d in disps])
            out_m = None
            if m_layer is not None:
                try:
                    out_m = m_layer.quant_method.apply(m_layer, d0).hidden_states.float()
                    r["marlin_path"] = "SGLang FusedMoE + CompressedTensorsWNA16MoE.apply_weights (fused_marlin_moe)"
                    r["marlin_us"], r["marlin_timing"] = time_graph(
                        [lambda d=d: m_layer.quant_method.apply(m_layer, d) for d in disps])
                except Exception as e:
                    out_m = None
                    r["marlin_error"] = f"{type(e).__name__}: {e}"[:400]
                    traceback.print_exc()
            if out_m is None and m_layer is not None and marlin_ok and DEV == "cuda":
                try:
                    fn, us = marlin_manual(raw, x, w0, ids0, E, group, rsf)
                    out_m = fn().float()
                    r["marlin_path"] = "moe_wna16_marlin_gemm x2 + torch SiLU/sum (peer_moe_bench style)"
                    r["marlin_us"], r["marlin_timing"] = us, "eager-events"
                except Exception as e:
                    r["marlin_manual_error"] = f"{type(e).__name__}: {e}"[:400]
                    traceback.print_exc()
            if out_m is not None:
                r["marlin_vs_ref_rel"] = rel(out_m, ref)
                r["kq_vs_marlin_rel"] = rel(out_kq, out_m)
                r["marlin_vs_ref_without_rsf_rel"] = rel(out_m, ref / rsf)  # must be large when rsf != 1
            r["ok"] = all(r.get(c, 0.0) <= TOL for c in ("kq_vs_ref_rel", "marlin_vs_ref_rel", "kq_vs_marlin_rel")) \
                and info["kq_weights_equal_prepack_of_loaded"] and info.get("same_rank_slice_as_marlin_layer", False) \
                and (not marlin_ok or "marlin_vs_ref_rel" in r)  # a Marlin run that produced nothing fails
            log(json.dumps(r))
            rows.append(r)
        kq_layer = m_layer = raw = disps = None  # free this rank's GPU memory
        if DEV == "cuda":
            torch.cuda.empty_cache()
    reader.close()
    return rows, ranks


def marlin_manual(raw, x, w, ids, E, group, rsf):
    """SGLang's Marlin MoE GEMM (JIT `moe_wna16_marlin_gemm`) on the same rank's weights, two
    stages with torch SiLU*up and the weighted top-k sum between/after. Returns (fn, us); the
    time excludes routing alignment (done in torch, as in peer_moe_bench) and uses events, not
    a CUDA graph."""
    for d in (REPO / ".gpu", REPO.parent / "shared" / "tools"):
        if (d / "peer_moe_bench.py").is_file():
            sys.path.insert(0, str(d))
            break
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


def _drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages (a file just written) are not dropped by DONTNEED
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def load_rows(folder: Path, group: int) -> list[dict]:
    """One rank's routed experts onto the GPU: kq shard file vs the unsharded checkpoint."""
    from kq.checkpoint.reader import CheckpointReader
    from kq.kernels import moe_lane_layout, prepack_moe
    from kq.sglang.rank_shards import PARAMS, cut_rank, expert_layers, rank_file, read_rank, shard_dir

    def prepack(t):  # what the plugin does with a rank's checkpoint-layout slices, either source
        lane = moe_lane_layout(t["w13_weight_packed"].device, t["w13_weight_packed"].shape[2] * 8,
                               t["w13_weight_packed"].shape[1] // 2)
        return prepack_moe(*(t[k] for k in PARAMS), group, lane=lane)

    d = shard_dir(folder, TP, 1)
    mf = json.loads((d / "manifest.json").read_text())
    idx = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    rows = []
    for rank in RANKS:
        f = d / rank_file(rank, 0)
        _drop_cache([f])
        t = time.perf_counter()
        for layer in mf["layers"]:
            pp = prepack(read_rank(f, layer, device=DEV))
        _sync()
        t_shard = time.perf_counter() - t
        del pp
        reader = CheckpointReader(folder)
        layers = expert_layers(reader)
        names = {n for ly in layers for n in reader.names() if n.startswith(ly.name + ".")}
        files = sorted({str(folder / idx[n]) for n in names})
        _drop_cache(files)
        t = time.perf_counter()
        for ly in layers:
            # What the plugin does without rank files: SGLang reads every expert tensor (all of
            # it), keeps this rank's slice, kq prepacks on the GPU.
            pp = prepack(cut_rank(_OnDevice(reader), ly, TP, 1, rank, 0, group))
        _sync()
        t_full = time.perf_counter() - t
        reader.close()
        del pp
        rows.append({"model": folder.name, "rank": rank, "rank_file_bytes": f.stat().st_size,
                     "checkpoint_files_bytes": sum(os.path.getsize(s) for s in files),
                     "shard_load_s": round(t_shard, 4), "unsharded_load_s": round(t_full, 4),
                     "speedup": round(t_full / t_shard, 2)})
        log(json.dumps(rows[-1]))
    return rows


class _OnDevice:
    """CheckpointReader whose tensors land on the GPU (the full tensor is read, as SGLang does)."""
    def __init__(self, reader):
        self.r = reader

    def raw(self, name):
        return self.r.raw(name).to(DEV)


def warm_marlin() -> int:
    """Compile what SGLang's Marlin MoE path JIT-builds (repack, Marlin MoE GEMM for the decode
    block sizes, align and activation kernels) on a small layer, through the same code
    (CompressedTensorsWNA16MoE on a FusedMoE) the check uses. The build lands in SGLang's JIT
    cache (SGLANG_JIT_CACHE_DIR, default ~/.cache/sglang/jit) and Triton's (~/.triton/cache)."""
    t = time.perf_counter()
    shim_moe_sum_reduce()
    # fused_marlin_moe reaches two variants of SGLang's Marlin MoE module (the second GEMM zeroes
    # inactive rows), each one nvcc run over hundreds of kernel instances, plus the repack module:
    # left to first use they compile one after another (> 6 min on the H200 machine). Built up
    # front in parallel (SGLang's parallel_compile: one nvcc per module under its own lock), the
    # calls below then find them cached and only build the small modules.
    import functools
    import threading

    from sglang.kernels.jit.utils import parallel_compile
    from sglang.kernels.ops.moe.moe_wna16_marlin import _jit_moe_wna16_marlin_module
    from sglang.kernels.ops.quantization.gptq_marlin_repack import _jit_gptq_marlin_repack_module
    # (dtype, is_ep, has_bias, expert_ids_are_sorted, zero_inactive_output, has_inactive_prefix_count),
    # as fused_marlin_moe passes them without an expert map and without biases
    builders = [functools.partial(_jit_moe_wna16_marlin_module, torch.bfloat16, False, False, True, zero, True)
                for zero in (False, True)] + [_jit_gptq_marlin_repack_module]

    def build():
        parallel_compile(builders)
        log(f"marlin modules built in parallel: {time.perf_counter() - t:.0f} s")
    bg = threading.Thread(target=build, daemon=True)
    bg.start()
    from sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe import fused_marlin_moe
    from sglang.srt.layers.quantization.marlin_utils import marlin_make_workspace, marlin_moe_permute_scales
    from sglang.srt.hardware_backend.gpu.quantization.gptq_kernels import gptq_marlin_moe_repack
    for E, H, I, k, g in ((16, 256, 128, 4, 32), (256, 512, 256, 8, 128)):
        wq13 = torch.randint(-2**31, 2**31 - 1, (E, H // 8, 2 * I), dtype=torch.int32, device=DEV)
        wq2 = torch.randint(-2**31, 2**31 - 1, (E, I // 8, H), dtype=torch.int32, device=DEV)
        perm = torch.empty((E, 0), dtype=torch.int32, device=DEV)
        w13 = gptq_marlin_moe_repack(wq13, perm, H, 2 * I, 4)
        w2 = gptq_marlin_moe_repack(wq2, perm, I, H, 4)
        s13 = marlin_moe_permute_scales(torch.rand(E, H // g, 2 * I, device=DEV).bfloat16() * 1e-2, H, 2 * I, g)
        s2 = marlin_moe_permute_scales(torch.rand(E, I // g, H, device=DEV).bfloat16() * 1e-2, I, H, g)
        ws = marlin_make_workspace(torch.device(DEV), 4)
        empty = torch.empty((E, 0), dtype=torch.int32, device=DEV)
        for T in (1, 16, 64):
            x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
            ids = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(T)]).to(torch.int32)
            fused_marlin_moe(x, w13, w2, s13, s2, torch.zeros(T, E, device=DEV), torch.rand(T, k, device=DEV), ids,
                             g_idx1=empty, g_idx2=empty, sort_indices1=empty, sort_indices2=empty, num_bits=4,
                             is_k_full=True, routed_scaling_factor=2.5, workspace=ws)
            torch.cuda.synchronize()
            log(f"marlin warm E={E} g={g} T={T}: {time.perf_counter() - t:.0f} s")
    bg.join()
    print("marlin warm", round(time.perf_counter() - t, 1), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="also one generated full-size GLM-5.2 MoE layer")
    ap.add_argument("--only-full", action="store_true", help="the full-size layer only")
    ap.add_argument("--tiny", choices=("auto", "generated"), default="auto",
                    help="auto: the trained tiny model when present, else a generated one")
    ap.add_argument("--tokens", default="1,16,64")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", default="/tmp/kq-gpu-check")
    ap.add_argument("--cpu-dry", action="store_true", help="CPU dry run (SGLang side venv): no CUDA kernels")
    ap.add_argument("--warm-marlin", action="store_true", help="JIT-compile SGLang's Marlin MoE path and exit")
    ap.add_argument("--no-marlin", action="store_true", help="leave SGLang's Marlin apply out (kq rows only)")
    ap.add_argument("--no-load", action="store_true", help="leave the load timing out")
    ap.add_argument("--prepare-only", action="store_true", help="step 1 only (quantize, shard), no SGLang")
    args = ap.parse_args()
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    dry = args.cpu_dry or DEV == "cpu"
    if dry:
        # As check_plugin.py: SGLang asks for a capability; the loader's CPU-only padded path off.
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
        import sglang.srt.layers.moe.fused_moe_triton.layer as fl
        fl._is_cpu = False
    elif args.warm_marlin:
        return warm_marlin()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    models = [True] if args.only_full else [False, True] if args.full else [False]
    if args.prepare_only:
        for full in models:
            print(prepare(work, full, args.tiny))
        return 0
    from sglang.srt.plugins import load_plugins
    load_plugins()
    res = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)", "torch": torch.__version__,
           "tolerance_rel": TOL, "sources": {}, "moe": [], "ranks": [], "load": [], "errors": []}
    try:
        import sglang
        res["sglang"] = sglang.__version__
    except Exception:
        pass
    marlin_ok = not dry and not args.no_marlin
    if marlin_ok:
        try:
            res["moe_sum_reduce"] = shim_moe_sum_reduce()
        except Exception as e:
            res["errors"].append(f"moe_sum_reduce shim: {type(e).__name__}: {e}"[:300])
    t_all = time.perf_counter()
    for full in models:
        name = "full" if full else "tiny"
        try:
            folder, group, what = prepare(work, full, args.tiny)
            res["sources"][name] = what
            log(f"== {name}: {what}")
            publish(folder)
            moe, ranks = moe_rows(folder, group, [int(t) for t in args.tokens.split(",")], dry, marlin_ok)
            res["moe"] += moe
            res["ranks"] += ranks
            if not args.no_load:
                res["load"] += load_rows(folder, group)
        except Exception as e:
            traceback.print_exc()
            res["errors"].append(f"{name}: {type(e).__name__}: {e}"[:500])
        Path(args.out, "gpu_check.json").write_text(json.dumps(res, indent=1))  # after each model
    res["seconds"] = round(time.perf_counter() - t_all, 1)
    Path(args.out, "gpu_check.json").write_text(json.dumps(res, indent=1))
    print(f"{res['device']}  torch {res['torch']}  sglang {res.get('sglang')}  ({res['seconds']} s)")
    for k, v in res["sources"].items():
        print(f"{k}: {v}")
    print(f"{'model':30} {'rank':>4} {'T':>3} {'rsf':>4} {'kq/ref':>9} {'marlin/ref':>10} {'kq/marlin':>9} "
          f"{'m/ref no rsf':>12} {'kq us':>8} {'marlin us':>9} ok")
    for r in res["moe"]:
        f = lambda k, fmt: (fmt % r[k]) if k in r else "-"
        print(f"{r['model'][:30]:30} {r['rank']:>4} {r['tokens']:>3} {r['rsf']:>4} {f('kq_vs_ref_rel', '%.2e'):>9} "
              f"{f('marlin_vs_ref_rel', '%.2e'):>10} {f('kq_vs_marlin_rel', '%.2e'):>9} "
              f"{f('marlin_vs_ref_without_rsf_rel', '%.2e'):>12} {f('kq_us', '%.1f'):>8} {f('marlin_us', '%.1f'):>9} "
              f"{'yes' if r['ok'] else 'NO'}")
    for r in res["ranks"]:
        print(f"rank {r['rank']} {r['model'][:30]}: rank file used {r['kq_used_rank_file']}, = prepack of loaded "
              f"{r['kq_weights_equal_prepack_of_loaded']}, same slice as Marlin layer "
              f"{r.get('same_rank_slice_as_marlin_layer')}, {r.get('marlin_method', '')}")
    if res["load"]:
        print(f"{'model':30} {'rank':>4} {'rank file MB':>12} {'ckpt MB':>9} {'shard load s':>12} {'unsharded s':>11} {'x':>6}")
    for r in res["load"]:
        print(f"{r['model'][:30]:30} {r['rank']:>4} {r['rank_file_bytes'] / 1e6:>12.1f} "
              f"{r['checkpoint_files_bytes'] / 1e6:>9.1f} {r['shard_load_s']:>12} {r['unsharded_load_s']:>11} "
              f"{r['speedup']:>6}")
    for p in sorted({r["marlin_path"] for r in res["moe"] if "marlin_path" in r}):
        print("marlin path:", p)
    if "moe_sum_reduce" in res:
        print("moe_sum_reduce:", res["moe_sum_reduce"])
    errs = res["errors"] + sorted({r[k] for r in res["moe"] + res["ranks"]
                                   for k in ("marlin_error", "marlin_manual_error") if k in r})
    for e in errs:
        print("ERROR", e)
    bad = [r for r in res["moe"] if not r["ok"]]
    return 1 if res["errors"] or bad or not res["moe"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""kq's RTN quantizer end to end, beside llm-compressor's `model_free_ptq`, on one generated checkpoint.

    python benchmarks/rtn.py --size tiny|medium|full [--layers N] [--device cpu|cuda]
                             [--runs kq,kq-absmax,llmc] [--llmc-python PATH] [--work DIR] [--profile]

What runs, each in its own subprocess (so one run's memory cannot hide in another's):
  kq          `python -m kq quantize SRC --out OUT --json --device D --group-size G` (clip mse, the default)
  kq-absmax   the same with `--clip absmax`
  kq-jN, kq-absmax-jN   the same with `--jobs N` (output shards written at once; kq's default is 8 on a GPU)
  …-prof      any kq run with KQ_PROFILE=1 (see --profile), e.g. kq-j8-prof
  …-nowb      any kq run with KQ_NO_WRITEBACK=1 (no early writeback; the fsync at close writes it all)
  …-swN       any kq run with KQ_SWITCH_INTERVAL_US=N (the interpreter's GIL switch interval, µs)
  …-gwN       any kq run with KQ_GPU_WORKERS=N (reader/quantizer threads per shard job on a GPU)
  ….N         a repeat of a run (kq.2, kq-nowb.3): same command, its own row
  llmc        llm-compressor 0.14's `model_free_ptq`, shard by shard from block FP8 through
              compressed-tensors' FP8BlockDequantizer, RTN W4A16: int4, symmetric, group G,
              targets = the routed experts only (the regex below), its default observer
  llmc-mse    the same with llm-compressor's MSE observer (kq's default clips by MSE too)
  llmc-wN     the same as llmc with max_workers=N (its own multi-worker mode)

Both tools read, dequantize, quantize, pack and write every shard; kq also hashes every
output file (sha256 manifest) and keeps the non-expert FP8 tensors byte for byte (llm-compressor
keeps them too here, because only the experts are targeted).

Per run: wall seconds of the whole process (imports and CUDA start included) and the tool's
own seconds (kq's --json "seconds"; the time around the model_free_ptq call), FP8 input GB/s
= source bytes / seconds, peak anonymous (non-file-backed) RSS of the process tree sampled
from /proc every 20 ms (benchmarks/_memwatch.py), output bytes. The page cache is warmed by
reading every source file once before the first run. The 756 GB projection divides by the
tool's own GB/s (start-up is paid once per run, not per shard).

The llm-compressor runs need llmcompressor 0.14 + compressed-tensors 0.19, which cannot share a
venv with sglang's pins: --llmc-python names the interpreter that has them (default: .venv-llmc
here, the current python when it imports llmcompressor, e.g. with wheels on PYTHONPATH).
JSON goes to $OUT/rtn.json when $OUT is set.

--profile runs kq with KQ_PROFILE=1: kq prints one line to stderr with the wall time per stage
summed over its threads (read, h2d, kernel, d2h, write, sha256, fsync, waits; see
kq/checkpoint/safetensors_io.py Profile); it lands in the row ("profile") and under the table.
The GPU stages are then separated by stream syncs, so a profiled run is slightly slower.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FULL_CHECKPOINT_BYTES = 756e9  # GLM-5.2-FP8 on the Hub (REFERENCE.md §1)
# The routed experts, as kq's glm5 recipe names them (MTP layer's experts included); not the
# shared experts (`mlp.shared_experts.*`), not the router (`mlp.gate`).
EXPERT_RE = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"
NOT_EXPERT_RE = r"re:^(?!.*mlp\.experts\.\d+\.(gate|up|down)_proj$).*"

# Checkpoint sizes. medium: real GLM-5.2 layer shapes (hidden 6144, I 2048, MLA, indexer) but
# only 8 routed experts, so the 2-core CPU run takes minutes; full: 256 experts (~9.9 GB a layer).
SIZES = {
    "tiny": dict(),
    "medium": dict(size="full", num_layers=1, n_experts=8, max_shard_bytes=128 << 20),
    "full": dict(size="full", max_shard_bytes=2 << 30),
}


# ----------------------------------------------------------------------------------------------
# The llm-compressor peer: run as `rtn.py --peer-llmc ...` under an interpreter that has it.
# Imports nothing from kq (kq is not installed in that venv).

def peer_llmc(src: str, out: str, device: str, group: int, workers: int, observer: str | None) -> None:
    import torch
    from compressed_tensors.entrypoints.convert.converters import FP8BlockDequantizer
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.entrypoints.model_free import model_free_ptq

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group,
                               **({"observer": observer} if observer else {}))
    scheme = QuantizationScheme(targets=[EXPERT_RE], weights=weights, format="pack-quantized")
    # Dequantize only the experts; every other FP8 weight keeps its bytes and weight_scale_inv.
    # `ignore` must name the others too, or the converter's check calls their scales orphans.
    deq = FP8BlockDequantizer(targets=[EXPERT_RE], ignore=[NOT_EXPERT_RE], weight_block_size=(128, 128))
    t0 = time.perf_counter()
    model_free_ptq(src, out, scheme=scheme, ignore=["lm_head"], max_workers=workers,
                   device=torch.device(device), converter=deq)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    print(json.dumps({"seconds": round(time.perf_counter() - t0, 3)}), flush=True)


# ----------------------------------------------------------------------------------------------
# The driver

def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def safetensor_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.glob("*.safetensors"))


def warm(p: Path) -> float:
    """Read every file once so every run starts from the page cache; returns seconds."""
    t0 = time.perf_counter()
    for f in sorted(p.iterdir()):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while fh.read(64 << 20):
                    pass
    return time.perf_counter() - t0


def packed_count(out: Path) -> int:
    """Number of INT4 tensors (`*.weight_packed`) in an output's index: both tools must agree."""
    idx = out / "model.safetensors.index.json"
    if not idx.exists():
        return -1
    return sum(k.endswith(".weight_packed") for k in json.loads(idx.read_text())["weight_map"])


def generate(size: str, layers: int, dst: Path, max_shard_mb: int | None = None) -> dict:
    sys.path.insert(0, str(REPO))
    from kq.synth import generate as gen

    opts = dict(SIZES[size])
    if size != "tiny":
        opts["num_layers"] = layers
    if max_shard_mb:
        opts["max_shard_bytes"] = max_shard_mb << 20
    t0 = time.perf_counter()
    gen("glm5", dst, overwrite=True, **opts)
    return {"options": opts, "seconds": round(time.perf_counter() - t0, 1)}


_ENV_TAGS = {"sw": "KQ_SWITCH_INTERVAL_US", "gw": "KQ_GPU_WORKERS"}


def _kq_tags(name: str) -> tuple[str, dict]:
    """kq-j4-sw500-nowb-prof.2 -> ("kq-j4", environment): a trailing .N only tells repeated runs
    apart; -prof, -nowb, -swN and -gwN set environment variables, not options."""
    env, keep = {}, []
    for part in name.split(".")[0].split("-"):
        tag = part.rstrip("0123456789")
        if part == "prof":
            env["KQ_PROFILE"] = "1"
        elif part == "nowb":
            env["KQ_NO_WRITEBACK"] = "1"     # no sync_file_range behind the writer: fsync at close does it all
        elif tag in _ENV_TAGS and part != tag:
            env[_ENV_TAGS[tag]] = part[len(tag):]
        else:
            keep.append(part)
    return "-".join(keep), env


def _kq_base(name: str) -> str:
    return _kq_tags(name)[0]


def run_cmd(name: str, args, src: Path, out: Path, llmc_python: str) -> list[str]:
    me = str(Path(__file__).resolve())
    if name.startswith("kq"):
        cmd = [sys.executable, "-m", "kq", "quantize", str(src), "--out", str(out), "--json",
               "--device", args.device, "--group-size", str(args.group)]
        base, _, jobs = _kq_base(name).partition("-j")
        if jobs:
            cmd += ["--jobs", jobs]
        return cmd + (["--clip", "absmax"] if base == "kq-absmax" else [])
    workers = int(name[len("llmc-w"):]) if name.startswith("llmc-w") else 1
    observer = "memoryless_mse" if name == "llmc-mse" else None  # its "mse" maps to a missing "static_mse" in 0.14
    cmd = [llmc_python, me, "--peer-llmc", str(src), str(out), "--device", args.device,
           "--group", str(args.group), "--workers", str(workers)]
    return cmd + (["--observer", observer] if observer else [])


@functools.cache
def _load_memwatch():
    """benchmarks/_memwatch.py by path: benchmarks/ stays off sys.path (see main)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_memwatch", HERE / "_memwatch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def one_run(name: str, args, src: Path, src_bytes: int, llmc_python: str, logs: Path,
            timeout: float | None) -> dict:
    run_watched = _load_memwatch().run_watched

    out = Path(args.work) / f"out-{name}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = run_cmd(name, args, src, out, llmc_python)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if name.startswith("kq"):
        env.update(_kq_tags(name)[1])
        if args.profile:
            env["KQ_PROFILE"] = "1"
    with open(logs / f"{name}.out", "wb") as so, open(logs / f"{name}.err", "wb") as se:
        w = run_watched(cmd, env=env, stdout=so, stderr=se, timeout=timeout)
    row = {"run": name, "rc": w["rc"], "wall_s": round(w["wall_s"], 2), "cpu_s": round(w["cpu_s"], 1),
           "timed_out": w["timed_out"],
           "peak_rss_anon_gb": round(w["peak_rss_anon_bytes"] / 1e9, 3), "mem_samples": w["samples"]}
    if w["rc"] != 0:
        shutil.rmtree(out, ignore_errors=True)
        row["error_tail"] = (logs / f"{name}.err").read_text(errors="replace")[-3000:]
        print(f"[{name}] FAILED rc={w['rc']}:\n{row['error_tail']}", file=sys.stderr)
        return row
    lines = [ln for ln in (logs / f"{name}.out").read_text().splitlines() if ln.startswith("{")]
    summary = json.loads(lines[-1]) if lines else {}
    tool_s = summary.get("seconds", w["wall_s"])
    if "profile" in summary:
        row["profile"] = summary["profile"]
        row["profile_line"] = next((ln for ln in (logs / f"{name}.err").read_text(errors="replace").splitlines()
                                    if ln.startswith("kq profile:")), "")
    row |= {"tool_s": round(tool_s, 2), "gbps_wall": round(src_bytes / w["wall_s"] / 1e9, 4),
            "gbps_tool": round(src_bytes / tool_s / 1e9, 4), "output_bytes": folder_bytes(out),
            "int4_tensors": packed_count(out)}
    man = out / "kq-manifest.json"
    if man.exists():  # kq rows of one clip mode must agree byte for byte, whatever --jobs or profiling
        files = json.loads(man.read_text())["files"]
        row["output_sha"] = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
    row["proj_756gb_min"] = round(FULL_CHECKPOINT_BYTES / (row["gbps_tool"] * 1e9) / 60, 1)
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)  # disk on the GPU machine is 64 GB
    print(f"[{name}] " + json.dumps({k: v for k, v in row.items() if k not in ("error_tail", "profile")}), flush=True)
    return row


def versions(llmc_python: str) -> dict:
    v = {"python": platform.python_version()}
    try:
        import torch
        v["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        import triton
        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = "-"
    from importlib.metadata import PackageNotFoundError, version
    try:
        v["kq"] = version("kq")
    except PackageNotFoundError:  # GPU machine: kq from the checkout on PYTHONPATH
        v["kq"] = "checkout"
    probe = ("import importlib.metadata as m, platform, torch, json; print(json.dumps({'python': platform.python_version(),"
             "'torch': torch.__version__, 'llmcompressor': m.version('llmcompressor'),"
             "'compressed-tensors': m.version('compressed-tensors')}))")
    try:
        peer = json.loads(subprocess.run([llmc_python, "-c", probe], capture_output=True, text=True,
                                         check=True).stdout)
        v["llmc_env"] = peer
    except (subprocess.CalledProcessError, json.JSONDecodeError, FileNotFoundError) as e:
        v["llmc_env"] = {"error": str(e)[:200]}
    # KQ_COMMIT first: the lent GPU machine gets a copy of the working tree whose git metadata can
    # lag behind it (runs 12-14 were labelled 030d085 there), so the caller names the commit
    v["kq_commit"] = os.environ.get("KQ_COMMIT") or (subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        or "?") + " (git there)"
    return v


def hardware(device: str) -> dict:
    cpu = "?"
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    h = {"cpu": cpu, "cores": os.cpu_count(), "loadavg_at_start": os.getloadavg()[0],
         "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)}
    if device.startswith("cuda"):
        import torch
        h["gpu"] = torch.cuda.get_device_name(0)
    return h


def table(rows: list[dict], peer: str) -> str:
    """Markdown; ratios against the llm-compressor run `peer` of the same invocation (> 1: kq better)."""
    base = next((r for r in rows if r["run"] == peer and r["rc"] == 0), None)
    head = ("| run | wall s | tool s | CPU s | FP8 in GB/s (tool) | GB/s (wall) | speed × llmc (tool) "
            "| speed × llmc (CPU s) | peak anon RSS GB | mem ÷ llmc | output GB | INT4 tensors | 756 GB at this rate |")
    ncol = head.count("|") - 1
    lines = [head, "|" + "---|" * ncol]
    for r in rows:
        if r["rc"] != 0:
            why = "skipped (deadline)" if r["rc"] == "skipped" else \
                "timed out" if r.get("timed_out") else f"failed (rc {r['rc']})"
            lines.append(f"| {r['run']} | {why} |" + " |" * (ncol - 2))
            continue
        sp = f"{r['gbps_tool'] / base['gbps_tool']:.2f}×" if base else "-"
        spc = f"{base['cpu_s'] / r['cpu_s']:.2f}×" if base and r["cpu_s"] else "-"
        mem = f"{r['peak_rss_anon_gb'] / base['peak_rss_anon_gb']:.2f}" if base and base["peak_rss_anon_gb"] else "-"
        proj = r["proj_756gb_min"]
        proj_s = f"{proj / 60:.1f} h" if proj >= 120 else f"{proj:.0f} min"
        lines.append(f"| {r['run']} | {r['wall_s']:.1f} | {r['tool_s']:.1f} | {r['cpu_s']:.0f} | {r['gbps_tool']:.3g} | "
                     f"{r['gbps_wall']:.3g} | {sp} | {spc} | {r['peak_rss_anon_gb']:.2f} | {mem} | "
                     f"{r['output_bytes'] / 1e9:.3f} | {r['int4_tensors']} | {proj_s} |")
    return "\n".join(lines)


def default_llmc_python() -> str:
    side = REPO / ".venv-llmc" / "bin" / "python"
    return str(side) if side.exists() else sys.executable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SIZES), default="medium")
    ap.add_argument("--layers", type=int, default=1, help="MoE layers for medium/full")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (both tools)")
    ap.add_argument("--group", type=int, default=128, help="INT4 group size (kq's GLM-5 default)")
    ap.add_argument("--runs", default="kq,kq-absmax,llmc",
                    help="comma list of kq, kq-absmax, kq-jN, kq-absmax-jN (…-prof), llmc, llmc-mse, llmc-wN")
    ap.add_argument("--llmc-python", default=None)
    ap.add_argument("--work", default=os.environ.get("KQ_BENCH_WORK", "/tmp/kq-rtn-bench"))
    ap.add_argument("--src", default=None, help="reuse this checkpoint instead of generating one")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no run later than this many seconds after the script started")
    ap.add_argument("--run-timeout-s", type=float, default=None, help="kill a run after this long")
    ap.add_argument("--keep", action="store_true", help="keep the outputs (and a generated source)")
    ap.add_argument("--profile", action="store_true",
                    help="every kq run with KQ_PROFILE=1 (a run named …-prof gets it alone): per-stage "
                         "thread-seconds in the row and under the table")
    ap.add_argument("--shards", action="store_true", help="print the source's shard files and sizes")
    ap.add_argument("--max-shard-mb", type=int, default=None,
                    help="cut the generated checkpoint into shards of about this size (full: 2048, i.e. 5 shards "
                         "a layer; kq writes one output shard per source shard, so fewer shards than --jobs "
                         "leaves jobs idle)")
    # the peer, run in its own interpreter
    ap.add_argument("--peer-llmc", nargs=2, metavar=("SRC", "OUT"))
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--observer", default=None)
    args = ap.parse_args()

    # Python put benchmarks/ first on sys.path; transformers probes for a package named `kernels`
    # (HF's kernel hub) and would import a benchmarks/kernels.py (now bench_kernels.py) instead.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    if args.peer_llmc:
        peer_llmc(*args.peer_llmc, args.device, args.group, args.workers, args.observer)
        return

    llmc_python = args.llmc_python or default_llmc_python()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"  # per-run stdout/stderr; error tails go into rtn.json
    logs.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    started = datetime.datetime.now(datetime.timezone.utc)
    info = {"date": started.strftime("%Y-%m-%d %H:%M UTC"), "size": args.size, "device": args.device,
            "group": args.group, "hardware": hardware(args.device), "versions": versions(llmc_python)}
    print(json.dumps(info), flush=True)

    if args.src:
        src = Path(args.src)
    else:
        src = work / f"src-{args.size}"
        info["generate"] = generate(args.size, args.layers, src, args.max_shard_mb)
        print(f"generated {src} in {info['generate']['seconds']} s", flush=True)
    src_bytes = safetensor_bytes(src)
    info["source_bytes"] = src_bytes
    info["warm_s"] = round(warm(src), 2)
    info["shards"] = {f.name: f.stat().st_size for f in sorted(src.glob("*.safetensors"))}
    if args.shards:
        print(f"{len(info['shards'])} source shards: "
              + ", ".join(f"{n} {b / 1e9:.3f} GB" for n, b in info["shards"].items()), flush=True)
    print(f"source {src_bytes / 1e9:.3f} GB of safetensors; page cache warmed in {info['warm_s']} s", flush=True)

    rows = []
    for name in args.runs.split(","):
        left = args.deadline_s - (time.perf_counter() - t_start) if args.deadline_s else None
        if left is not None and left <= 0:
            print(f"[{name}] skipped: past --deadline-s", flush=True)
            rows.append({"run": name, "rc": "skipped"})
            continue
        # Flush the dirty pages the previous run left (llm-compressor does not fsync its output, so
        # without this its gigabytes are written back during the next run), outside any timing.
        t = time.perf_counter()
        os.sync()
        flush_s = round(time.perf_counter() - t, 2)
        row = one_run(name, args, src, src_bytes, llmc_python, logs, args.run_timeout_s)
        row["flush_before_s"] = flush_s
        rows.append(row)
    info["rows"] = rows
    peer = next((n for n in args.runs.split(",") if n.startswith("llmc")), "llmc")
    hw = info["hardware"]
    v = info["versions"]
    pv = v.get("llmc_env", {})
    md = [f"RTN end to end, GLM-5.2 layer shapes ({args.size}, {src_bytes / 1e9:.2f} GB FP8 safetensors), "
          f"group {args.group}, device {args.device}; {info['date']}",
          f"hardware: {hw.get('gpu', '') + ' / ' if 'gpu' in hw else ''}{hw['cpu']}, {hw['cores']} cores, "
          f"{hw['mem_gb']} GB RAM, load average {hw['loadavg_at_start']:.1f} at start",
          f"kq {v['kq']} ({v['kq_commit']}), python {v['python']}, torch {v.get('torch')}, triton {v['triton']}; "
          f"peer: llmcompressor {pv.get('llmcompressor')}, compressed-tensors {pv.get('compressed-tensors')}, "
          f"torch {pv.get('torch')}, python {pv.get('python')}",
          "GB/s = FP8 source bytes / seconds; 'tool s' excludes process start-up (kq's own --json seconds; "
          "the time around model_free_ptq); CPU s = user+sys of the process tree, start-up included; "
          "peak anon RSS = RssAnon (not file-backed) summed over the process tree, sampled from /proc every "
          "20 ms; source in page cache; dirty pages flushed (sync) before each run; "
          "756 GB projection = 756e9 / tool GB/s.",
          f"source: {len(info['shards'])} safetensors shards of {min(info['shards'].values()) / 1e9:.2f}–"
          f"{max(info['shards'].values()) / 1e9:.2f} GB (kq writes one output shard per source shard)",
          "", table(rows, peer)]
    md += [f"{r['run']}: {r['profile_line']}" for r in rows if r.get("profile_line")]
    for clip in ("kq", "kq-absmax"):
        shas = {r["run"]: r["output_sha"] for r in rows if r.get("output_sha")
                and _kq_base(r["run"]).partition("-j")[0] == clip}
        if len(shas) > 1:
            same = len(set(shas.values())) == 1
            info.setdefault("kq_outputs_identical", {})[clip] = same
            md.append(f"{clip} rows {', '.join(shas)}: output sha256s {'identical' if same else 'DIFFER: ' + json.dumps(shas)}")
    text = "\n".join(md)
    info["table"] = text
    print("\n" + text, flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "rtn.json").write_text(json.dumps(info, indent=1))
    if not args.keep and not args.src:
        shutil.rmtree(src, ignore_errors=True)
    if any(r["rc"] not in (0, "skipped") for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()

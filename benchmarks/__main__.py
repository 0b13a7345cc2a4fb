"""kq's benchmark suite: one entry point, one script per table of record in BENCHMARKS.md.

    python -m benchmarks rtn [ARGS]        rtn.py: kq's RTN end to end beside llm-compressor's model_free_ptq
    python -m benchmarks gptq [ARGS]       gptq_layer_gpu.py: kq's GPTQ on one full-size GLM-5.2 layer
    python -m benchmarks kernels [ARGS]    bench_kernels.py, then kernel_table.py's tables of its rows
    python -m benchmarks kernels --table ROWS...   kernel_table.py only, on rows already written
    python -m benchmarks gptq-dist [ARGS]  gptq_dist_gpu.py: one torchrun rank's GPTQ stages, projected to N GPUs
    python -m benchmarks w4a8 [ARGS]       w4a8_bench.py: the W4A8 prefill MoE against SGLang's FP8 MoE and kq W4A16
    python -m benchmarks quality [ARGS]    quality.py: KL / top-1 / perplexity of kq and llm-compressor (GPTQ, AWQ)
    python -m benchmarks w4afp8 [ARGS]     w4afp8_quality.py: the KL cost of FP8 expert activations
    python -m benchmarks decode [ARGS]     decode_pool.py: pair eval, MTP acceptance, FP8 KV cache
    python -m benchmarks sglang [ARGS]     sglang_check.py: kq's SGLang plugin against SGLang's Marlin MoE,
                                           per-rank loading

ARGS go to the script (`python -m benchmarks NAME --help` shows them). Every run first prints its
provenance, the lines a table of record cites: the command, kq's commit (KQ_COMMIT when set, else
git's), the versions it runs with, the date (UTC) and the machine. On a GPU machine the wrappers
gpu_kernels.sh, gpu_rtn.sh, gpu_quality.sh (quality and gptq) and gpu_sglang.sh install the peers'
wheels and run these.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SCRIPTS = {"rtn": "rtn.py", "gptq": "gptq_layer_gpu.py", "gptq-dist": "gptq_dist_gpu.py", "kernels": "bench_kernels.py",
           "w4a8": "w4a8_bench.py", "quality": "quality.py", "w4afp8": "w4afp8_quality.py", "decode": "decode_pool.py",
           "sglang": "sglang_check.py"}
PACKAGES = ("torch", "triton", "transformers", "safetensors", "compressed-tensors", "llmcompressor", "sglang")


def commit() -> str:
    if os.environ.get("KQ_COMMIT"):
        return os.environ["KQ_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return head + (" (uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (set KQ_COMMIT)"


def versions() -> str:
    out = [f"python {platform.python_version()}"]
    for name in PACKAGES:
        try:
            out.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


def machine() -> str:
    gpu = ""
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,power.limit", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().replace("\n", "; ")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return f"{platform.machine()}, {os.cpu_count()} CPUs" + (f", GPU {gpu} (driver, power limit)" if gpu else ", no GPU")


def provenance(argv: list[str]) -> str:
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join([f"# command: python -m benchmarks {' '.join(argv)}", f"# kq commit: {commit()}",
                      f"# versions: {versions()}", f"# date: {date}", f"# machine: {machine()}"])


def run(script: str, args: list[str]) -> int:
    return subprocess.call([sys.executable, str(HERE / script), *args], cwd=REPO)


def kernels(args: list[str]) -> int:
    """bench_kernels.py's rows into --out (a temporary folder by default), then their tables."""
    if args[:1] == ["--table"]:
        return run("kernel_table.py", args[1:])
    if "-h" in args or "--help" in args:
        return run("bench_kernels.py", args)
    if "--out" not in args:
        args = ["--out", tempfile.mkdtemp(prefix="kq-kernels-"), *args]
    out = Path(args[args.index("--out") + 1])
    rc = run("bench_kernels.py", args)
    rows = out / "kernels_bench.json"
    if rows.exists():
        print(f"\n# tables: python -m benchmarks kernels --table {rows}", flush=True)
        rc = run("kernel_table.py", [str(rows)]) or rc
    return rc


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    name, args = argv[0], argv[1:]
    if name not in SCRIPTS:
        print(f"benchmarks: unknown benchmark {name!r}; one of {', '.join(SCRIPTS)}", file=sys.stderr)
        return 2
    if "-h" not in args and "--help" not in args:
        print(provenance(argv), flush=True)
    return kernels(args) if name == "kernels" else run(SCRIPTS[name], args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

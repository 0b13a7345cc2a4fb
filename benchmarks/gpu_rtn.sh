#!/usr/bin/env bash
# On the lent H200, from the repo root: benchmarks/rtn.py on full-size GLM-5.2 layer shapes, kq on cuda
# beside llm-compressor 0.14's model_free_ptq on cuda, in one call. Table and JSON land in $OUT.
#   carry: .whl-rtn   (git-ignored via .git/info/exclude; 4.3 MB of Python 3.12 wheels that the image lacks:
#          llmcompressor 0.14.0.1, compressed-tensors 0.19.0, loguru, pydantic + pydantic-core,
#          annotated-types, typing-inspection, typing-extensions, and datasets + multiprocess + dill,
#          which `import llmcompressor` pulls in through its dataset arguments)
# Default rows (one call, ~3 min of commands on a warm machine): llm-compressor, kq with default
# options (--jobs 8 on a GPU), kq --jobs 4, then the default again with KQ_PROFILE=1 (kq's per-stage
# breakdown, printed under the table). The full layer is 5 source shards of ~2 GB and kq writes one
# output shard per source shard, so --jobs 4 leaves a 5th shard running alone at the end; 8 does not.
# Knobs: LAYERS (MoE layers of ~9.9 GB each, default 1), RUNS, DEADLINE_S (no run starts after it),
#        RUN_TIMEOUT_S (a run is killed after it), MAX_SHARD_MB (cut the generated layer finer),
#        WORK (scratch folder on the local disk). KQ_BENCH_DRY=1 rehearses the logic on this CPU
#        machine: tiny checkpoint, device cpu, .venv / .venv-llmc interpreters, wheels only unpacked.
#
# `bash benchmarks/gpu_rtn.sh --download` (here, with PyPI) fetches the wheels into .whl-rtn/. The set was
# found by importing both tools (-X importtime) and checking each top-level package against the
# image's package list (/work/.library/device/KINDS.md); versions are the ones .venv-llmc runs.
WHEELS="llmcompressor==0.14.0.1 compressed-tensors==0.19.0 loguru==0.7.3 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 datasets==5.2.0 multiprocess==0.70.19
  dill==0.4.1"
if [ "$1" = --download ]; then
  mkdir -p .whl-rtn
  grep -qx '/.whl-rtn/' .git/info/exclude 2>/dev/null || echo '/.whl-rtn/' >> .git/info/exclude
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl-rtn $WHEELS
fi
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
WORK=${WORK:-/tmp/kq-rtn}
LAYERS=${LAYERS:-1}
RUNS=${RUNS:-llmc,kq,kq-j4,kq-prof}
DEADLINE_S=${DEADLINE_S:-170}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-90}
EXTRA=(--shards)
[ -n "$MAX_SHARD_MB" ] && EXTRA+=(--max-shard-mb "$MAX_SHARD_MB")
SITE=/tmp/site
if [ -n "$KQ_BENCH_DRY" ]; then
  PY=.venv/bin/python; LLMC_PY=.venv-llmc/bin/python; SIZE=tiny; DEV=cpu; SITE=/tmp/site-dry
  # only a Python 3.12 can import the cp312 wheels: here check that the set installs as one
  PIPX=(--python-version 3.12 --implementation cp --only-binary=:all:
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
else
  PY=python3; LLMC_PY=python3; SIZE=full; DEV=cuda; PIPX=()
fi
rm -rf "$SITE"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "${PIPX[@]}" \
  --target "$SITE" .whl-rtn/*.whl || exit 1
[ -z "$KQ_BENCH_DRY" ] && export PYTHONPATH=$SITE:$PWD
{ date -u; df -h "$(dirname "$WORK")" | tail -1; nproc; free -g | head -2
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null; } | tee "$OUT/machine.txt"
# What the image brings that the peer depends on (datasets wants pyarrow >= 24, fsspec <= 2026.9).
"$LLMC_PY" - <<'EOF' 2>&1 | tee -a "$OUT/machine.txt"
import importlib.metadata as m
def v(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return "missing"
print(", ".join(f"{n} {v(n)}" for n in ("torch", "triton", "transformers", "pyarrow", "fsspec", "pandas",
                                        "typing_extensions", "huggingface_hub", "safetensors", "pydantic")))
EOF
# Preflight: if the peer cannot import here, still measure kq (and say why the peer is missing).
if ! "$LLMC_PY" -c "from llmcompressor.entrypoints.model_free import model_free_ptq" > "$OUT/llmc_import.log" 2>&1; then
  echo "llm-compressor does not import here (tail of $OUT/llmc_import.log):"; tail -5 "$OUT/llmc_import.log"
  RUNS=$(echo "$RUNS" | tr ',' '\n' | grep -v '^llmc' | paste -sd,)
fi
"$PY" benchmarks/rtn.py --size "$SIZE" --layers "$LAYERS" --device "$DEV" --runs "$RUNS" \
  --llmc-python "$LLMC_PY" --work "$WORK" --deadline-s "$DEADLINE_S" --run-timeout-s "$RUN_TIMEOUT_S" \
  "${EXTRA[@]}" 2>&1 | tee "$OUT/rtn.log"
rc=$?
rm -rf "$WORK"
# Correctness of kq's GPU path in the same call (after the timings): deterministic across --jobs,
# equal to the Triton kernel called plainly, non-finite scales refused. GPU_TESTS=0 skips it.
if [ -z "$KQ_BENCH_DRY" ] && [ "${GPU_TESTS:-1}" != 0 ]; then
  timeout 150 "$PY" -m pytest -q -m gpu tests/gpu/test_run_gpu.py tests/unit/test_rtn_triton.py -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
exit $rc

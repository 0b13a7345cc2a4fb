#!/usr/bin/env bash
# On the lent H200, from the repo root: the GPU kernel tests, then benchmarks/bench_kernels.py (args passed on).
# Logs and the JSON tables land in $OUT. The SGLang peers need, carried along (both git-ignored):
#   .whl/        sglang 0.5.23 + apache-tvm-ffi 0.1.11, orjson, pybase64, msgspec, pyzmq, dill, gguf, starlette,
#                pydantic, pydantic-core, annotated-types, typing-inspection (Python 3.12 wheels)
#   .gpu/stubs/  IPython stub (../shared/tools/stubs) and sgl_kernel/{__init__,scalar_type}.py (sgl_kernel 0.3.21)
# MARLIN=1 also times SGLang's JIT Marlin MoE: its build (minutes) runs in the background meanwhile.
# DRY=1:   the same flow on a CPU (no wheels, no nvidia-smi; interpreter tests);
#          PY picks the interpreter (default python3).
set -o pipefail
OUT=${OUT:-out}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
WHL=${KQ_WHL:-.whl}   # .whl-slim (27 MB: sglang and what its kernels import) is enough for the peers
if [ -z "$DRY" ] && ls "$WHL"/*.whl >/dev/null 2>&1; then
  SITE=${KQ_SITE:-/tmp/site}  # another script running beside this one on the same machine needs its own
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl || exit 1
  export PYTHONPATH=$SITE:$PWD/.gpu/stubs:$PWD
else
  export PYTHONPATH=$PWD
fi
if [ -z "$DRY" ]; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
fi
WARM=
if [ -n "$MARLIN" ]; then
  "$PY" benchmarks/bench_kernels.py --warm-marlin > "$OUT/marlin_warm.log" 2>&1 &
  WARM=$!
fi
if [ -z "$SKIP_TESTS" ]; then
  if [ -n "$DRY" ]; then TESTS=tests/test_kernels_interpreter.py; else TESTS="-m gpu tests/test_kernels_gpu.py"; fi
  # shellcheck disable=SC2086
  "$PY" -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
fi
"$PY" benchmarks/bench_kernels.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v sweep
if [ -n "$WARM" ]; then
  wait "$WARM"; tail -3 "$OUT/marlin_warm.log"
  "$PY" benchmarks/bench_kernels.py --out "$OUT" "$@" --no-kq --peers marlin --skip-dense --tag _marlin 2>&1 \
    | tee "$OUT/bench_marlin.log" | grep -v sweep
fi

# W4A8 prefill MoE on the GPU machine, from a copy of the worktree holding sglang_py.tgz (SGLang 0.5.23's
# Python files), whl/ (its small dependencies) and stubs/ (IPython, sgl_kernel stand-ins):
#   TESTS=1 BENCH="--check --tokens 4096 --shapes glm52" bash benchmarks/gpu_w4a8.sh
# The CUDA lane kernel (kq's W4A16 path on Hopper) builds in the background from the start; its log is
# $OUT/lanes_build.log. Results: $OUT/pytest_w4a8.log, $OUT/w4a8.jsonl, $OUT/gpu.txt.
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/kq_ext
T0=$(date +%s)
if [ ! -d /tmp/site/sglang ]; then
  mkdir -p /tmp/site && tar xzf sglang_py.tgz -C /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD/stubs:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
if [ -n "$LANES" ]; then
  (python3 -c "from kq.kernels.cuda_lanes import build; build(); print('built')" > "$OUT/lanes_build.log" 2>&1 &)
fi
if [ -n "$TESTS" ]; then
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS_ARGS:-tests/gpu/test_w4a8_gpu.py} \
    > "$OUT/pytest_w4a8.log" 2>&1
  tail -1 "$OUT/pytest_w4a8.log"; grep -E "FAILED|Error" "$OUT/pytest_w4a8.log" | head -5
  echo "tests done after $(( $(date +%s) - T0 )) s"
fi
if [ -n "$LANES" ]; then
  for _ in $(seq 1 "${LANES_WAIT:-60}"); do grep -q built "$OUT/lanes_build.log" 2>/dev/null && break; sleep 2; done
  echo "lanes build: $(tail -1 "$OUT/lanes_build.log") after $(( $(date +%s) - T0 )) s"
fi
timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/w4a8_bench.py $BENCH --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc $? after $(( $(date +%s) - T0 )) s"
if [ -n "$BENCH2" ]; then     # a second run into the same rows (e.g. the crossover sizes)
  timeout "${BENCH2_TIMEOUT:-120}" python3 benchmarks/w4a8_bench.py $BENCH2 --out "$OUT" > "$OUT/bench2.log" 2>&1
  echo "bench2 rc $? after $(( $(date +%s) - T0 )) s"
fi
python3 benchmarks/w4a8_table.py "$OUT/w4a8.jsonl" 2>&1 | tail -40
grep -v '^{' "$OUT/bench.log" | tail -8

#!/usr/bin/env bash
# The W4A8 prefill MoE's table of record on one H200, in two calls (each under the device's 10 minutes):
#   PART=a bash benchmarks/gpu_w4a8.sh   the W4A8 GPU tests (not with SKIP_TESTS=1), moe_align at prefill sizes
#                                        (benchmarks/moe_align_check.py), `w4a8_bench.py --check`, GLM-5.2 at 2048
#                                        tokens with every variant and at 4096 without the W4A16 lane kernel;
#   PART=b bash benchmarks/gpu_w4a8.sh   GLM-5.2 at 16384 tokens and Kimi K2 at 2048, 4096 and 16384, with kq W4A8,
#                                        SGLang's FP8 MoE and its GEMMs alone, kq's W4A16 Triton kernel.
# (The lane kernel is kept to 2048 tokens: at prefill sizes it takes most of a call.) Burst and sustained rows
# (after 1 s of back-to-back replay), then the table (w4a8_table.py) of the call's
# rows. SWEEP=1 runs the stage sweeps instead (`--sweep`, GLM-5.2 at 2048/4096/16384). Set
# KQ_COMMIT: the device's git metadata can lag the tree it runs.
# carry: .whl-slim .gpu        results: $OUT/w4a8/{pytest_w4a8.log, moe_align_check.log, w4a8.jsonl, bench.log, gpu.txt}
# Each bench step has its own timeout; rows are written as they come, each with its elapsed seconds.
source benchmarks/gpu_common.sh w4a8
export KQ_COMMIT=${KQ_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}
NO_LANE=kq_w4a8,sgl_fp8,sgl_fp8_gemms,kq_w4a16_tiles
step() {   # timeout, then w4a8_bench.py's arguments
  local limit=$1; shift
  timeout "$limit" python3 benchmarks/w4a8_bench.py --sustained 1.0 --out "$R" "$@" >> "$R/bench.log" 2>&1
  echo "$* rc $? after $(( $(date +%s) - T0 )) s"
}
if [ -n "$SWEEP" ]; then
  step 330 --sweep --tokens 2048,4096,16384 --shapes glm52 --variants kq_w4a8,sgl_fp8
elif [ "${PART:-a}" = a ]; then
  if [ -z "$SKIP_TESTS" ]; then
    timeout "${TEST_TIMEOUT:-100}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_w4a8_gpu.py \
      > "$R/pytest_w4a8.log" 2>&1
    tail -1 "$R/pytest_w4a8.log"; grep -E "^FAILED|^E  " "$R/pytest_w4a8.log" | head -8
    timeout 40 python3 benchmarks/moe_align_check.py 2>&1 | tee "$R/moe_align_check.log" | tail -3
    echo "tests done after $(( $(date +%s) - T0 )) s"
  fi
  step 200 --check --tokens 2048 --shapes glm52
  step 170 --tokens 4096 --shapes glm52 --variants $NO_LANE
else
  step 150 --tokens 16384 --shapes glm52 --variants $NO_LANE
  step 330 --tokens 2048,4096,16384 --shapes kimi --variants $NO_LANE
fi
grep '"check"' "$R/w4a8.jsonl" | cut -c1-200
python3 benchmarks/w4a8_table.py "$R/w4a8.jsonl" 2>&1 | tail -30

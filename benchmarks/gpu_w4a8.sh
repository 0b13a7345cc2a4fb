#!/usr/bin/env bash
# The W4A8 prefill MoE's table of record on one H200, one call: `bash benchmarks/gpu_w4a8.sh`.
#  - the W4A8 GPU tests (not with SKIP_TESTS=1) and moe_align at prefill sizes (benchmarks/moe_align_check.py);
#  - `w4a8_bench.py --check` at GLM-5.2 2048 and 4096 tokens, every variant, burst and sustained rows;
#  - GLM-5.2 at 16384 and Kimi K2 at 4096 with kq W4A8, SGLang's FP8 MoE (and its GEMMs alone) and kq's W4A16
#    Triton kernel only
#    (the lane kernel takes too long there for one call);
#  - the table (w4a8_table.py) of all rows.
# SWEEP=1 replaces the whole-MoE runs with the stage sweeps (`--sweep`, GLM-5.2 at 2048/4096/16384).
# carry: .whl-slim .gpu        results: $OUT/w4a8/{pytest_w4a8.log, moe_align_check.log, w4a8.jsonl, gpu.txt}
# Budget: about 460 s with the tests; each bench step has its own timeout (rows are written as they come).
source benchmarks/gpu_common.sh w4a8
export KQ_COMMIT=${KQ_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}
if [ -z "$SKIP_TESTS" ]; then
  timeout "${TEST_TIMEOUT:-100}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_w4a8_gpu.py \
    > "$R/pytest_w4a8.log" 2>&1
  tail -1 "$R/pytest_w4a8.log"; grep -E "^FAILED|^E  " "$R/pytest_w4a8.log" | head -8
  timeout 40 python3 benchmarks/moe_align_check.py 2>&1 | tee "$R/moe_align_check.log" | tail -3
  echo "tests done after $(( $(date +%s) - T0 )) s"
fi
if [ -n "$SWEEP" ]; then
  timeout 330 python3 benchmarks/w4a8_bench.py --sweep --tokens 2048,4096,16384 --shapes glm52 \
    --variants kq_w4a8,sgl_fp8 --out "$R" > "$R/bench.log" 2>&1
  echo "sweep rc $? after $(( $(date +%s) - T0 )) s"
else
  timeout 200 python3 benchmarks/w4a8_bench.py --check --tokens 2048,4096 --shapes glm52 --sustained 1.0 \
    --out "$R" > "$R/bench.log" 2>&1
  echo "bench rc $? after $(( $(date +%s) - T0 )) s"
  for s in "glm52 16384 110" "kimi 4096 80"; do
    set -- $s
    timeout "$3" python3 benchmarks/w4a8_bench.py --tokens "$2" --shapes "$1" \
      --variants kq_w4a8,sgl_fp8,sgl_fp8_gemms,kq_w4a16_tiles \
      --sustained 1.0 --out "$R" >> "$R/bench.log" 2>&1
    echo "$1 $2 rc $? after $(( $(date +%s) - T0 )) s"
  done
fi
grep '"check"' "$R/w4a8.jsonl" | cut -c1-200
python3 benchmarks/w4a8_table.py "$R/w4a8.jsonl" 2>&1 | tail -30

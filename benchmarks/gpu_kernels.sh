#!/usr/bin/env bash
# The kernel tables of record on one H200, one call: `bash benchmarks/gpu_kernels.sh`.
#  - SGLang's JIT Marlin MoE build starts first, in the background (about 300 s of nvcc on the host CPUs;
#    a cache hit when .gpu/sgl_jit.tgz, the build an earlier run saved as $OUT/sgl_jit.tgz, travels);
#  - meanwhile the kernel GPU tests (not with SKIP_TESTS=1);
#  - then `python -m benchmarks kernels`: one process, every MoE shape of MOE (default all four:
#    glm52,kimi_tp8,kimi,glm47) at 1/16/64 tokens and groups 128 and 32, kq's picked CUDA instance, its
#    whole MoE, SGLang's Marlin MoE as SGLang runs it (stage and whole path), SGLang's FP8 MoE, and the
#    dense rows against cuBLAS BF16 / FP8 and torch int4; one pass per GPU state of STATES (default
#    burst,sustained: idle IDLE_S s before each timing / HEAT_S s of back-to-back replay first), each
#    state's kernels interleaved case by case; the tables are printed at the end, one per state;
#  - the GPU's clocks and power every 100 ms meanwhile ($R/clocks.csv), per row in $R/clock_rows.txt.
# carry: .whl-slim .gpu        results: $OUT/kernels.tgz (and $OUT/sgl_jit.tgz when the build ran here)
# Budget: with the tests and a cached Marlin build, about 400-550 s for all four shapes; split the
# shapes over two calls (MOE=glm52,kimi_tp8 then MOE=kimi,glm47) if a call's limit is closer.
source benchmarks/gpu_common.sh kernels
export SGLANG_JIT_CACHE_DIR=/tmp/sgl_jit
mkdir -p "$SGLANG_JIT_CACHE_DIR"
[ -f .gpu/sgl_jit.tgz ] && tar xzf .gpu/sgl_jit.tgz -C "$SGLANG_JIT_CACHE_DIR" && echo "marlin cache unpacked"
timeout "${MARLIN_WARM_TIMEOUT:-420}" python3 benchmarks/bench_kernels.py --warm-marlin --groups 128,32 \
  > "$R/marlin_warm.log" 2>&1 &
W=$!
[ "${SKIP_TESTS:-0}" = 1 ] || kernel_tests
wait $W; echo "marlin warm rc $? after $(( $(date +%s) - T0 )) s"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 100 > "$R/clocks.csv" 2>&1 &
C=$!
timeout "${BENCH_TIMEOUT:-480}" python3 -m benchmarks kernels --out "$R" --lanes --picked-only --no-tiles \
  --peers dense,fp8,marlin --moe "${MOE:-glm52,kimi_tp8,kimi,glm47}" --tokens "${TOKENS:-1,16,64}" \
  --groups 128,32 --dense-m "${DENSE_M:-1,16,32,64,4096}" --states "${STATES:-burst,sustained}" \
  --idle-s "${IDLE_S:-0.5}" --heat-s "${HEAT_S:-1.0}" 2>&1 | tee "$R/kernels.log" | grep -v '^{'
echo "kernels rc $? after $(( $(date +%s) - T0 )) s"
kill $C
python3 benchmarks/clock_rows.py "$R/kernels.log" "$R/clocks.csv" > "$R/clock_rows.txt" 2>&1; head -1 "$R/clock_rows.txt"
grep -iE "Traceback|error" "$R"/*.log | head -5
[ -f .gpu/sgl_jit.tgz ] || tar czf "$OUT/sgl_jit.tgz" -C "$SGLANG_JIT_CACHE_DIR" .
tar czf "$OUT/kernels.tgz" -C "$OUT" kernels && rm -rf "$R"

#!/usr/bin/env bash
# The decode table of record on one lent H200 (nvidia-h200), one call, with SGLang's Marlin MoE:
#  - Marlin's JIT build starts first in the background (about 300 s of nvcc on the host CPUs), into
#    SGLANG_JIT_CACHE_DIR=/tmp/sgl_jit; when .gpu/sgl_jit.tgz travels (a build saved by an earlier
#    call of this script: $OUT/rec/sgl_jit.tgz, copied there by hand) it is unpacked first, and the
#    build is a cache hit;
#  - meanwhile the kernel GPU tests (not with SKIP_TESTS=1), the decode table (bench_kernels.py --lanes on the MoE shapes
#    MOE, default all four shapes of #3: glm52,kimi_tp8,kimi,glm47, against cuBLAS and
#    SGLang's FP8 MoE at 1/16/64 tokens, groups 128 and 32, with the dense rows), and with NCU=1
#    Nsight Compute on the lane kernel's picked instances (benchmarks/ncu_lanes.py);
#  - then Marlin's rows in a second process (the routings are seeded per case: the same ones).
#  - the GPU's clocks meanwhile ($R/clocks.csv, nvidia-smi every 100 ms), summarised at the end, and per row (benchmarks/clock_rows.py).
# carry: .whl-slim .gpu        results: $OUT/rec.tgz (and $OUT/rec/sgl_jit.tgz when it was built here)
source benchmarks/gpu_common.sh rec
export SGLANG_JIT_CACHE_DIR=/tmp/sgl_jit
mkdir -p "$SGLANG_JIT_CACHE_DIR"
[ -f .gpu/sgl_jit.tgz ] && tar xzf .gpu/sgl_jit.tgz -C "$SGLANG_JIT_CACHE_DIR" && echo "marlin cache unpacked"
timeout "${MARLIN_WARM_TIMEOUT:-480}" python3 benchmarks/bench_kernels.py --warm-marlin > "$R/marlin_warm.log" 2>&1 &
W=$!
# the GPU's clocks, power, temperature and throttle reasons every 100 ms while the rows run (the same
# instance's time moved by 5-11 % between two rounds of one process in the tenth session's first call)
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 100 > "$R/clocks.csv" 2>&1 &
C=$!
[ "${SKIP_TESTS:-0}" = 1 ] || kernel_tests
decode_rows
if [ "${NCU:-0}" = 1 ]; then
  timeout "${NCU_TIMEOUT:-120}" ncu --clock-control none -k regex:moe_lanes_kernel --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats \
    python3 benchmarks/ncu_lanes.py > "$R/ncu_lanes.log" 2>&1
  echo "ncu rc $? after $(( $(date +%s) - T0 )) s"
fi
wait $W; echo "marlin warm rc $? after $(( $(date +%s) - T0 )) s"
timeout "${MARLIN_TIMEOUT:-100}" python3 benchmarks/bench_kernels.py --out "$R" --no-kq --peers marlin --skip-dense \
  --moe "${MOE:-glm52,kimi_tp8,kimi,glm47}" --tokens 1,16,64 --groups 128,32 --tag _marlin > "$R/marlin.log" 2>&1
echo "marlin rows rc $? after $(( $(date +%s) - T0 )) s"
kill $C
python3 benchmarks/clock_rows.py "$R/decode.log" "$R/clocks.csv" > "$R/clock_rows.txt" 2>&1; head -1 "$R/clock_rows.txt"
python3 benchmarks/kernel_table.py "$R/decode.log" "$R/marlin.log"
grep -E "glm52 \| (16|64)" "$R/clock_rows.txt"
grep -iE "Traceback|error" "$R"/*.log | head -5
[ -f .gpu/sgl_jit.tgz ] || tar czf "$OUT/sgl_jit.tgz" -C "$SGLANG_JIT_CACHE_DIR" . && ls -la "$OUT"
tar czf "$OUT/rec.tgz" -C "$OUT" rec && rm -rf "$R"

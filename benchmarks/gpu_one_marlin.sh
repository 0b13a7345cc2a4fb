#!/usr/bin/env bash
# Decode table with SGLang's Marlin MoE on one lent H200 (nvidia-h200), one call: Marlin's JIT build
# (about 300 s of nvcc on the host CPUs) starts first; meanwhile bench_kernels.py --lanes against
# SGLang's FP8 MoE at 1/16/64 tokens, groups 128 and 32; then Marlin's rows in a second process, on
# the same routings since bench_kernels seeds them per case (before that change, which came after
# this script's only run, the two processes shared only the first case's routings).
# carry: .whl-slim .gpu        results: $OUT/marlin1.tgz
source benchmarks/gpu_common.sh marlin1
timeout 360 python3 benchmarks/bench_kernels.py --warm-marlin > "$R/marlin_warm.log" 2>&1 &
W=$!
timeout "${DECODE_TIMEOUT:-150}" python3 benchmarks/bench_kernels.py --out "$R" --lanes --peers fp8 \
  --moe glm52,kimi_tp8 --tokens 1,16,64 --groups 128,32 --skip-dense > "$R/decode.log" 2>&1
echo "decode rc $? after $(( $(date +%s) - T0 )) s"
wait $W; echo "marlin warm rc $? after $(( $(date +%s) - T0 )) s"
timeout "${MARLIN_TIMEOUT:-100}" python3 benchmarks/bench_kernels.py --out "$R" --no-kq --peers marlin --skip-dense \
  --moe glm52,kimi_tp8 --tokens 1,16,64 --groups 128,32 --tag _marlin > "$R/marlin.log" 2>&1
echo "marlin rows rc $? after $(( $(date +%s) - T0 )) s"
python3 benchmarks/kernel_table.py "$R/decode.log" "$R/marlin.log"
tar czf "$OUT/marlin1.tgz" -C "$OUT" marlin1 && rm -rf "$R"

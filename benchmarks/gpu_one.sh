#!/usr/bin/env bash
# The kernel table on one lent H200 (nvidia-h200), in one call: the kernel GPU tests, then
# bench_kernels.py --lanes against SGLang's FP8 MoE and cuBLAS (decode sizes at groups 128 and 32 with
# the dense rows; then 192 and 4096 tokens at group 128). SGLang's Marlin MoE needs the JIT build of
# minutes: benchmarks/gpu_record.sh runs it beside the decode table.
# carry: .whl-slim .gpu        results: $OUT/one.tgz
source benchmarks/gpu_common.sh one
kernel_tests
decode_rows
timeout "${PREFILL_TIMEOUT:-200}" python3 benchmarks/bench_kernels.py --out "$R" --lanes --peers fp8 --tag _prefill \
  --moe glm52,kimi_tp8 --tokens 192,4096 --groups 128 --skip-dense > "$R/prefill.log" 2>&1
echo "prefill rc $? after $(( $(date +%s) - T0 )) s"
python3 benchmarks/kernel_table.py "$R/decode.log" "$R/prefill.log"
grep -iE "Traceback|error" "$R"/*.log | head -5
tar czf "$OUT/one.tgz" -C "$OUT" one && rm -rf "$R"

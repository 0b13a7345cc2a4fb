#!/usr/bin/env bash
# One call on a lent 2-GPU H200 (nvidia-h200-x2), sixth session: the dense linear on the lane layout
# (the CUDA kernel's DENSE instances, cuda_lanes.linear) and where the MoE stands at prefill.
#   GPU 1: build the extension, the kernel GPU tests (tests/test_kernels_gpu.py,
#          tests/test_kernels_lanes_gpu.py), then benchmarks/moe_prefill_probe.py (GLM-5.2, 4096 tokens).
#   GPU 0: once the extension is built, bench_kernels.py --lanes --skip-moe: dense kq on both layouts
#          (every dense instance of the CUDA kernel up to 64 rows) against cuBLAS BF16 / FP8 and tinygemm;
#          then the lane MoE at 1 token, group 32 (its K-split instances no longer spill) beside SGLang FP8.
# carry: .whl-slim .gpu        results: $OUT/dense.tgz
set -o pipefail
OUT=${OUT:-out}; R=$OUT/dense; mkdir -p "$R"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_EXTENSIONS_DIR=/tmp/kq_ext
T0=$(date +%s)
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$R/gpu.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-p .whl-slim/*.whl
( export CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$PWD
  timeout 120 python3 -c "from kq.kernels import cuda_lanes; cuda_lanes._ext(); print('built')"
  echo "build rc $? after $(( $(date +%s) - T0 )) s"; touch "$R/built"
  # shellcheck disable=SC2086
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/test_kernels_lanes_gpu.py \
    tests/test_kernels_gpu.py} > "$R/pytest_gpu.log" 2>&1
  tail -3 "$R/pytest_gpu.log"; grep -E "^FAILED|Error" "$R/pytest_gpu.log" | head -10
  PYTHONPATH=/tmp/site-p:$PWD/.gpu/stubs:$PWD timeout "${PROBE_TIMEOUT:-200}" python3 benchmarks/moe_prefill_probe.py \
    --out "$R" ${PROBE_ARGS:-} > "$R/prefill.log" 2>&1
  echo "probe rc $? after $(( $(date +%s) - T0 )) s" ) > "$R/steps.log" 2>&1 &
S=$!
for _ in $(seq 150); do [ -f "$R/built" ] && break; sleep 1; done
( export CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site-p:$PWD/.gpu/stubs:$PWD
  timeout "${KERN_TIMEOUT:-360}" python3 benchmarks/bench_kernels.py --out "$R" --lanes --skip-moe --peers dense \
    --dense-m ${DENSE_M:-1,2,4,8,16,32,64,128,512,4096} ) > "$R/run.log" 2>&1
echo "dense rc $? after $(( $(date +%s) - T0 )) s"
[ "${MOE1:-1}" = 1 ] && ( export CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site-p:$PWD/.gpu/stubs:$PWD
  timeout "${MOE_TIMEOUT:-120}" python3 benchmarks/bench_kernels.py --out "$R" --lanes --tag _moe1 --peers fp8 \
    --moe kimi_tp8,glm52 --tokens 1 --groups 32 --skip-dense ) > "$R/run_moe1.log" 2>&1
echo "moe 1-token rc $? after $(( $(date +%s) - T0 )) s"
wait $S
cat "$R/steps.log"
cat "$R"/run*.log | grep '^{' | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    if 'us' in r and 'case' in r:
        print(f\"{r['case'][:14]:14s} M={r['M']:<5d} {r['kind']:28s} {r['us']:9.2f} us {r.get('GBps','')!s:>7s} {'*' if r.get('picked') else ''}\")
    elif 'error' in r: print('ERR', r)
"
grep -iE "Traceback|Error" "$R/run.log" | head -5
grep -v '^{' "$R/prefill.log" | tail -50
tar czf "$OUT/dense.tgz" -C "$OUT" dense && rm -rf "$R"

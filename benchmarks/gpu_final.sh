#!/usr/bin/env bash
# The kernel table of record, one call on a lent 2-GPU H200 (nvidia-h200-x2), the GPUs side by side:
#   GPU 0: bench_kernels.py --lanes: kq's MoE on the lane layout (the CUDA decode kernel's instances and
#          the whole MoE through kq.kernels.fused_moe_w4a16) and on the tiles layout (Triton), SGLang's
#          Triton MoE in BF16 / FP8 / INT4, dense kq against cuBLAS BF16 / FP8 and torch's int4 kernel.
#   GPU 1: SGLang's JIT Marlin MoE build in the background, meanwhile the kernel GPU tests
#          (tests/test_kernels_gpu.py, tests/test_kernels_lanes_gpu.py), then Marlin's rows.
# carry: .whl-slim .gpu        results: $OUT/final.tgz
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT/gpu0" "$OUT/gpu1"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_EXTENSIONS_DIR=/tmp/kq_ext
T0=$(date +%s)
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu0/gpu.txt"
( export CUDA_VISIBLE_DEVICES=1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-m .whl-slim/*.whl
  PYTHONPATH=/tmp/site-m:$PWD/.gpu/stubs:$PWD timeout 420 python3 benchmarks/bench_kernels.py --warm-marlin \
    > "$OUT/gpu1/marlin_warm.log" 2>&1 &
  W=$!
  PYTHONPATH=$PWD timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gpu.py \
    tests/test_kernels_lanes_gpu.py > "$OUT/gpu1/pytest_gpu.log" 2>&1
  tail -3 "$OUT/gpu1/pytest_gpu.log"
  wait $W; echo "marlin warm rc $? after $(( $(date +%s) - T0 )) s"
  LEFT=$(( ${BUDGET_S:-560} - ($(date +%s) - T0) ))
  PYTHONPATH=/tmp/site-m:$PWD/.gpu/stubs:$PWD timeout $LEFT python3 benchmarks/bench_kernels.py --out "$OUT/gpu1" \
    --no-kq --peers marlin --skip-dense --moe glm52,kimi_tp8 --tokens 16,64,1 --groups 128,32 --tag _marlin \
    > "$OUT/gpu1/bench_marlin.log" 2>&1
  echo "marlin rows rc $?" ) > "$OUT/gpu1/steps.log" 2>&1 &
S=$!
( export CUDA_VISIBLE_DEVICES=0 OUT=$OUT/gpu0 KQ_WHL=.whl-slim KQ_SITE=/tmp/site-k SKIP_TESTS=1
  timeout "${KERN_TIMEOUT:-530}" bash benchmarks/gpu_kernels.sh --lanes --peers dense,triton --moe glm52,kimi_tp8 \
    --tokens 1,16,64,4096 --groups 128,32 --dense-m 1,16,64,512,4096 ) > "$OUT/gpu0/run.log" 2>&1
echo "gpu0 rc $? after $(( $(date +%s) - T0 )) s"
wait $S
cat "$OUT/gpu1/steps.log"
grep -v '^{' "$OUT/gpu0/run.log" | grep -E "M=|driver" | grep -vE "_n[12]k[14]s[46]|nf " | tail -90
grep -v '^{' "$OUT/gpu1/bench_marlin.log" | grep -E "M=|Error" | tail -14
tar czf "$OUT/final.tgz" -C "$OUT" gpu0 gpu1 && rm -rf "$OUT/gpu0" "$OUT/gpu1"

#!/usr/bin/env bash
# One call on a lent 2-GPU H200 (nvidia-h200-x2) for the experimental CUDA decode MoE (kq/kernels/cuda_lanes.py):
#   GPU 1: build the extension, benchmarks/lanes_check.py (stage-by-stage errors, one-hot input map), the
#          GPU tests tests/test_kernels_lanes_gpu.py, Nsight Compute on one GLM-5.2 decode step (kq's Triton
#          stages, the lane kernel's NCU_LANES instances, SGLang's FP8 gate+up; NCU=0 skips), then with
#          SANITIZE=1 compute-sanitizer memcheck on the small checks.
#   GPU 0: once the extension is built, bench_kernels.py --lanes beside kq's Triton MoE and SGLang's FP8 MoE.
# carry: .whl-slim .gpu      results: $OUT/lanes.tgz
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT/lanes"
R=$OUT/lanes
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_EXTENSIONS_DIR=/tmp/kq_ext PYTHONPATH=$PWD
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$R/gpu.txt"
which nvcc; nvcc --version | tail -2
( export CUDA_VISIBLE_DEVICES=1
  timeout 240 python3 benchmarks/lanes_check.py > "$R/check.log" 2>&1; echo "check rc $?"
  touch "$R/built"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_lanes_gpu.py > "$R/pytest.log" 2>&1
  tail -3 "$R/pytest.log"
  if [ "${NCU:-1}" != 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-n .whl-slim/*.whl
    PYTHONPATH=/tmp/site-n:$PWD/.gpu/stubs:$PWD timeout 200 ncu --clock-control none \
      -k regex:"w4a16_gemm_kernel|fused_moe_kernel|moe_lanes_kernel" --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --print-details all \
      python3 benchmarks/ncu_moe.py --variants base --lanes "${NCU_LANES:-1x4}" --sgl-fp8 > "$R/ncu.log" 2>&1
    echo "ncu rc $?"
  fi
  if [ -n "$SANITIZE" ]; then
    timeout 200 compute-sanitizer --tool memcheck python3 benchmarks/lanes_check.py > "$R/memcheck.log" 2>&1
    echo "memcheck rc $?"; grep -E "ERROR SUMMARY|Invalid" "$R/memcheck.log" | head -5
  fi ) > "$R/steps.log" 2>&1 &
S=$!
for _ in $(seq 240); do [ -f "$R/built" ] && break; sleep 1; done
( export CUDA_VISIBLE_DEVICES=0 OUT=$R KQ_WHL=.whl-slim KQ_SITE=/tmp/site-k SKIP_TESTS=1
  timeout "${KERN_TIMEOUT:-420}" bash benchmarks/gpu_kernels.sh --lanes ${BENCH_ARGS:---peers fp8 --moe glm52,kimi_tp8 --tokens 1,16,64 --groups 128,32 --skip-dense} ) > "$R/run.log" 2>&1
echo "bench rc $?"
wait $S
cat "$R/steps.log"; cat "$R/check.log" | tail -30
grep -v "^{" "$R/run.log" | tail -50; grep -iE "error|Traceback" "$R/run.log" | head -8
tar czf "$OUT/lanes.tgz" -C "$OUT" lanes && rm -rf "$R"

#!/usr/bin/env bash
# One call on a lent 2-GPU H200 machine (nvidia-h200-x2): a kernel A/B on GPU 0 while GPU 1 runs
# the kernel tests, an Nsight Compute look at one decode MoE step, and repeated RTN end-to-end runs.
#   carry: .whl-slim .gpu .whl-rtn      logs: $OUT/ab/*, $OUT/rtn/*
#   VARIANTS (bench_kernels.VARIANTS names), RTN_RUNS (benchmarks/rtn.py run names), NCU=0 skips ncu.
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT/ab" "$OUT/rtn"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
VARIANTS=${VARIANTS:-old,base,st4,bn128}
RTN_RUNS=${RTN_RUNS:-llmc,kq,kq-nowb,kq.2,kq-nowb.2,kq.3,kq-nowb.3}
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/ab/gpu.txt"
( export CUDA_VISIBLE_DEVICES=0 OUT=$OUT/ab KQ_WHL=.whl-slim KQ_SITE=/tmp/site-ab SKIP_TESTS=1
  timeout ${AB_TIMEOUT:-480} bash benchmarks/gpu_kernels.sh --variants "$VARIANTS" --peers fp8 \
    --moe glm52,kimi_tp8 --tokens 16,64,1 --groups 128,32 --dense-m 1,16,64 ) > "$OUT/ab/run.log" 2>&1 &
AB=$!
( export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gpu.py > "$OUT/rtn/pytest_gpu.log" 2>&1
  tail -3 "$OUT/rtn/pytest_gpu.log"
  if [ "${NCU:-1}" != 0 ]; then
    timeout 90 ncu --clock-control none -k regex:w4a16_gemm_kernel --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section SchedulerStats --section LaunchStats \
      python3 benchmarks/ncu_moe.py --variants old,base > "$OUT/rtn/ncu.log" 2>&1
    echo "ncu rc $?"
  fi
  OUT=$OUT/rtn RUNS=$RTN_RUNS DEADLINE_S=${RTN_DEADLINE_S:-250} RUN_TIMEOUT_S=80 \
    timeout 300 bash benchmarks/gpu_rtn.sh > "$OUT/rtn/run.log" 2>&1
  echo "rtn rc $?" ) > "$OUT/rtn/steps.log" 2>&1 &
RT=$!
wait $AB; echo "ab rc $?"; wait $RT
cat "$OUT/rtn/steps.log"
grep -v '^{' "$OUT/ab/run.log" | tail -80
tail -22 "$OUT/rtn/run.log"
# the device tool brings back few files: one archive per side
tar czf "$OUT/ab.tgz" -C "$OUT" ab && tar czf "$OUT/rtn.tgz" -C "$OUT" rtn && rm -rf "$OUT/ab" "$OUT/rtn"

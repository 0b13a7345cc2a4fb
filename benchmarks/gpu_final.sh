#!/usr/bin/env bash
# One call on a lent 2-GPU H200 machine (nvidia-h200-x2): on GPU 0 the kernel table with the shipped
# tile heuristics (benchmarks/gpu_kernels.sh: SGLang's Triton MoE in BF16 / FP8 / INT4, cuBLAS BF16 /
# FP8, torch's int4 tinygemm); on GPU 1 the kernel tests, Nsight Compute on one decode MoE step (kq's
# gate+up and down before/after FOLD, and SGLang's FP8 MoE kernel on the same routing: stall reasons,
# memory traffic), then RTN end-to-end rows against llm-compressor.
#   carry: .whl-slim .gpu .whl-rtn      results: $OUT/kern.tgz, $OUT/side.tgz
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT/kern" "$OUT/side"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RTN_RUNS=${RTN_RUNS:-llmc,kq,kq.2,kq.3,llmc.2,kq.4}
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/kern/gpu.txt"
( export CUDA_VISIBLE_DEVICES=0 OUT=$OUT/kern KQ_WHL=.whl-slim KQ_SITE=/tmp/site-k SKIP_TESTS=1
  timeout ${KERN_TIMEOUT:-500} bash benchmarks/gpu_kernels.sh --peers dense,triton --moe kimi_tp8,glm52 \
    --tokens 1,16,64 --groups 32,128 --dense-m 1,16,64,512,4096 ) > "$OUT/kern/run.log" 2>&1 &
K=$!
( export CUDA_VISIBLE_DEVICES=1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-n .whl-slim/*.whl
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gpu.py > "$OUT/side/pytest_gpu.log" 2>&1
  tail -3 "$OUT/side/pytest_gpu.log"
  PYTHONPATH=/tmp/site-n:$PWD/.gpu/stubs:$PWD timeout 150 ncu --clock-control none -k regex:"w4a16_gemm_kernel|fused_moe_kernel" \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --print-details all \
    python3 benchmarks/ncu_moe.py --variants old,base --sgl-fp8 > "$OUT/side/ncu.log" 2>&1
  echo "ncu rc $?"
  OUT=$OUT/side RUNS=$RTN_RUNS DEADLINE_S=${RTN_DEADLINE_S:-220} RUN_TIMEOUT_S=80 \
    timeout 280 bash benchmarks/gpu_rtn.sh > "$OUT/side/rtn_run.log" 2>&1
  echo "rtn rc $?" ) > "$OUT/side/steps.log" 2>&1 &
S=$!
wait $K; echo "kernels rc $?"; wait $S
cat "$OUT/side/steps.log"
grep -v '^{' "$OUT/kern/run.log" | tail -60
tail -14 "$OUT/side/rtn_run.log"
tar czf "$OUT/kern.tgz" -C "$OUT" kern && tar czf "$OUT/side.tgz" -C "$OUT" side && rm -rf "$OUT/kern" "$OUT/side"

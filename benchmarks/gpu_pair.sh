#!/usr/bin/env bash
# One call on a lent 2-GPU H200 machine (nvidia-h200-x2), the two GPUs working side by side:
#   GPU 0: with VARIANTS set, an A/B of kq tile-config variants (bench_kernels.py --variants, SGLang's
#          FP8 MoE as the anchor); without, the full kernel table with the shipped heuristics
#          (SGLang's Triton MoE in BF16 / FP8 / INT4, cuBLAS BF16 / FP8, torch's int4 tinygemm).
#   GPU 1: the kernel tests, Nsight Compute on one decode MoE step (kq's gate+up and down for
#          NCU_VARIANTS, then SGLang's FP8 MoE kernel on the same routing: stall reasons, memory
#          traffic; NCU=0 skips it), then RTN_RUNS through benchmarks/gpu_rtn.sh (RTN_RUNS=none skips).
# carry: .whl-slim .gpu .whl-rtn      results: $OUT/gpu0.tgz, $OUT/gpu1.tgz (the tool brings few files back)
# This session's calls ran it as gpu_ab.sh (VARIANTS=old,base,st4,bn128, RTN_RUNS with -nowb rows) and
# gpu_final.sh (no VARIANTS, RTN_RUNS=llmc,kq,kq.2,kq.3,llmc.2,kq.4).
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT/gpu0" "$OUT/gpu1"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RTN_RUNS=${RTN_RUNS:-llmc,kq,kq.2,kq.3,llmc.2,kq.4}
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu0/gpu.txt"
if [ -n "$VARIANTS" ]; then
  ARGS=(--variants "$VARIANTS" --peers fp8 --moe glm52,kimi_tp8 --tokens 16,64,1 --groups 128,32 --dense-m 1,16,64)
else
  ARGS=(--peers dense,triton --moe kimi_tp8,glm52 --tokens 1,16,64 --groups 32,128 --dense-m 1,16,64,512,4096)
fi
( export CUDA_VISIBLE_DEVICES=0 OUT=$OUT/gpu0 KQ_WHL=.whl-slim KQ_SITE=/tmp/site-k SKIP_TESTS=1
  timeout "${KERN_TIMEOUT:-480}" bash benchmarks/gpu_kernels.sh "${ARGS[@]}" ) > "$OUT/gpu0/run.log" 2>&1 &
K=$!
( export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gpu.py > "$OUT/gpu1/pytest_gpu.log" 2>&1
  tail -3 "$OUT/gpu1/pytest_gpu.log"
  if [ "${NCU:-1}" != 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-n .whl-slim/*.whl
    PYTHONPATH=/tmp/site-n:$PWD/.gpu/stubs:$PWD timeout 150 ncu --clock-control none \
      -k regex:"w4a16_gemm_kernel|fused_moe_kernel" --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --print-details all \
      python3 benchmarks/ncu_moe.py --variants "${NCU_VARIANTS:-old,base}" --sgl-fp8 > "$OUT/gpu1/ncu.log" 2>&1
    echo "ncu rc $?"
  fi
  [ "$RTN_RUNS" = none ] && exit 0
  OUT=$OUT/gpu1 RUNS=$RTN_RUNS DEADLINE_S=${RTN_DEADLINE_S:-220} RUN_TIMEOUT_S=80 \
    timeout 280 bash benchmarks/gpu_rtn.sh > "$OUT/gpu1/rtn_run.log" 2>&1
  echo "rtn rc $?" ) > "$OUT/gpu1/steps.log" 2>&1 &
S=$!
wait $K; echo "gpu0 rc $?"; wait $S
cat "$OUT/gpu1/steps.log"
grep -v '^{' "$OUT/gpu0/run.log" | tail -60
[ -f "$OUT/gpu1/rtn_run.log" ] && tail -14 "$OUT/gpu1/rtn_run.log"
tar czf "$OUT/gpu0.tgz" -C "$OUT" gpu0 && tar czf "$OUT/gpu1.tgz" -C "$OUT" gpu1 && rm -rf "$OUT/gpu0" "$OUT/gpu1"

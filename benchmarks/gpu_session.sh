#!/usr/bin/env bash
# One call on the lent H200 for everything that needs the GPU besides the kernel sweep
# (benchmarks/gpu_kernels.sh): the GPU tests (kernels re-checked after their last changes,
# the one-pass RTN kernel), the end-to-end RTN benchmark against llm-compressor
# (benchmarks/gpu_rtn.sh), and the GPTQ full-size layer timing when its script exists.
# Carry: .whl-rtn (see gpu_rtn.sh). Each step has its own time limit; logs land in $OUT.
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-rtn/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
echo "== GPU tests"
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gpu.py tests/test_rtn_triton.py \
  2>&1 | tee "$OUT/pytest_gpu.log" | tail -6
echo "== RTN end to end"
DEADLINE_S=${DEADLINE_S:-170} RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-80} RUNS=${RUNS:-kq,llmc,kq-absmax} \
  timeout 280 bash benchmarks/gpu_rtn.sh 2>&1 | tail -25
if [ -f benchmarks/gptq_layer_gpu.py ]; then
  echo "== GPTQ one full-size layer"
  timeout ${GPTQ_TIMEOUT:-100} python3 benchmarks/gptq_layer_gpu.py 2>&1 | tee "$OUT/gptq.log" | tail -12
fi

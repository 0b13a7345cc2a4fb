# Sourced by the one-GPU scripts (gpu_one.sh, gpu_one_marlin.sh): results folder $R = $OUT/$1, the
# SGLang wheels from .whl-slim installed into /tmp/site-$1 and put on PYTHONPATH with the stubs in
# .gpu/stubs, the GPU's name, driver and clocks into $R/gpu.txt; T0 = the start, for elapsed times.
set -o pipefail
OUT=${OUT:-out}; R=$OUT/$1; mkdir -p "$R"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/kq_ext
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/site-$1" .whl-slim/*.whl
export PYTHONPATH=/tmp/site-$1:$PWD/.gpu/stubs:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$R/gpu.txt"

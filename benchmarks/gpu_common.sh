# Sourced by benchmarks/gpu_kernels.sh on a GPU machine: results folder $R = $OUT/$1, the SGLang wheels
# from .whl-slim and .gpu/ct (compressed-tensors 0.18.0; benchmarks/gpu_wheels.sh makes both) installed into /tmp/site-$1 and put on PYTHONPATH with the stubs in .gpu/stubs, the
# GPU's name, driver and clocks into $R/gpu.txt; T0 = the start, for elapsed times; kernel_tests, the
# kernel GPU tests.
set -o pipefail
OUT=${OUT:-out}; R=$OUT/$1; mkdir -p "$R"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/kq_ext
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/site-$1" .whl-slim/*.whl \
  .gpu/ct/*.whl || { echo "wheel install failed (bash benchmarks/gpu_wheels.sh, then carry .whl-slim .gpu)"; exit 1; }
export PYTHONPATH=/tmp/site-$1:$PWD/.gpu/stubs:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv | tee "$R/gpu.txt"

# GPU tests into $R/$1.log (default pytest_gpu), the arguments after $1 going to pytest (default: the
# kernel GPU tests); TEST_TIMEOUT (default 170 s)
kernel_tests() {
  local log=${1:-pytest_gpu}; shift $(( $# > 0 ))
  [ $# -gt 0 ] || set -- tests/gpu/test_kernels_gpu.py tests/gpu/test_kernels_lanes_gpu.py
  timeout "${TEST_TIMEOUT:-170}" python3 -m pytest -q -p no:cacheprovider -m gpu "$@" > "$R/$log.log" 2>&1
  tail -1 "$R/$log.log"; grep FAILED "$R/$log.log" | head
  echo "$log done after $(( $(date +%s) - T0 )) s"
}

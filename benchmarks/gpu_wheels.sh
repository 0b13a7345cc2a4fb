#!/usr/bin/env bash
# Here (with PyPI), before a GPU call: the git-ignored folders the GPU scripts carry, since the GPU machine has no
# internet and lacks SGLang and its small dependencies.
#   .whl        sglang 0.5.23 (cp312) and the small wheels its MoE/quantization imports reach on the GPU machine
#   .whl-slim   the same, sglang without its Rust server extensions and test folders (benchmarks/slim_wheel.py)
#   .gpu/ct     compressed-tensors 0.18.0 (SGLang's pin) and loguru
#   .gpu/stubs  IPython (imported only for notebooks) and sgl_kernel: kq's stand-in (tests/sglang/stubs) plus
#               scalar_type.py, the one pure-Python file SGLang's Marlin path needs from the 535 MB sgl_kernel wheel
#   .gpu/peer_moe_bench.py   the shared peer harness (../shared/tools)
#     bash benchmarks/gpu_wheels.sh            # then: carry .whl-slim .gpu (about 30 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
PLAT="--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform any"
get() {  # folder, wheels...
  local d=$1; shift
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d "$d" "$@"
}
get .whl sglang==0.5.23 apache-tvm-ffi==0.1.11 orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0 \
  dill==0.4.1 gguf==0.19.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 openai==2.8.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 partial-json-parser==0.2.1.1.post7
python3 benchmarks/slim_wheel.py .whl .whl-slim
get .gpu/ct compressed-tensors==0.18.0 loguru==0.7.3
mkdir -p .gpu/stubs/sgl_kernel
cp -r ../shared/tools/stubs/IPython .gpu/stubs/
cp ../shared/tools/peer_moe_bench.py .gpu/
cp tests/sglang/stubs/sgl_kernel/__init__.py .gpu/stubs/sgl_kernel/
if [ ! -f .gpu/stubs/sgl_kernel/scalar_type.py ]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  get "$tmp" sgl-kernel==0.3.21
  python3 - "$tmp"/sgl_kernel-*.whl <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    open(".gpu/stubs/sgl_kernel/scalar_type.py", "wb").write(z.read("sgl_kernel/scalar_type.py"))
PY
fi
grep -qx '/.whl-slim/' .gitignore || echo '/.whl-slim/' >> .gitignore
du -sh .whl-slim .gpu

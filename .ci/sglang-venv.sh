#!/usr/bin/env bash
# Creates (or reuses) the side venv in which SGLang 0.5.23's Python code imports on a
# CPU-only machine, and installs this checkout of kq into it (editable, so the
# `sglang.srt.plugins` entry point is registered). Prints the venv's path on stdout
# (last line); progress goes to stderr.
#
# Why a side venv: sglang 0.5.23 pins compressed-tensors 0.18.0 and torch 2.14.1 while the
# main venv holds compressed-tensors 0.19.0 (llmcompressor) and torch 2.13.0; they cannot
# share one environment (shared/REFERENCE.md §2-§3).
#
# Why outside the repo: CI runs on a fresh clone in another folder of the same machine,
# so the venv is cached under ~/.cache, keyed by a hash of the pinned list below; a
# changed list gives a new folder. Reuse costs a few seconds (re-pointing the editable
# kq install at the calling checkout when it moved).
#
#   --path           print where the venv is (or would be) and exit: builds nothing
#   KQ_SGLANG_VENV   use this folder instead of the hashed cache path
#   KQ_SGLANG_PYTHON interpreter to build the venv from (default python3; cp311 wheels
#                    of torch 2.14.1 / torchvision 0.29.1 lie on this machine's disk)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${KQ_SGLANG_PYTHON:-python3}

# torch/torchvision pull their CUDA runtime wheels (torch's import needs libcudnn even
# without a GPU); those resolve from the machine's local indexes. sglang goes in with
# --no-deps: its full dependency set (CUDA kernels, flashinfer, ...) is several GB and not
# needed to import its config, model and scheme-selection code. einops, openai and
# partial-json-parser: imported by sglang's model registry (deepseek_v2, glm4_moe, ...).
REQS='torch==2.14.1
torchvision==0.29.1
compressed-tensors==0.18.0
transformers==5.17.0
orjson==3.13.0
pybase64==1.5.1
requests==2.34.2
triton==3.8.0
pillow==13.0.0
starlette==1.10.0
msgspec==0.23.0
pyzmq==27.3.0
IPython==9.18.1
aiohttp==3.14.5
apache-tvm-ffi==0.1.11
dill==0.4.1
sentencepiece==0.2.3
gguf==0.19.0
safetensors==0.8.0
typer==0.29.2
rich==15.0.0
PyYAML==6.0.4
einops==0.8.2
openai==3.57.0
partial-json-parser==0.2.1.1.post7'
NODEPS='sglang==0.5.23'

PYVER=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
HASH=$(printf '%s\n%s\n%s\n' "$REQS" "$NODEPS" "$PYVER" | sha256sum | cut -c1-12)
VENV=${KQ_SGLANG_VENV:-$HOME/.cache/kq/sglang-venv-$HASH}
if [ "${1:-}" = "--path" ]; then
  echo "$VENV"
  exit 0
fi
mkdir -p "$(dirname "$VENV")"

# One builder at a time (parallel test runs, CI beside a developer).
exec 9>"$VENV.lock"
flock 9

log() { echo "[sglang-venv] $*" >&2; }

if [ ! -f "$VENV/.kq-ready" ]; then
  # A folder without the marker is a half-built venv from an interrupted run.
  rm -rf "$VENV"
  log "building $VENV (python $PYVER); a few minutes"
  start=$SECONDS
  "$PY" -m venv "$VENV"
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q $REQS >&2
  "$VENV/bin/python" -m pip install -q --no-deps $NODEPS >&2
  # The import the probe depends on; fail here, not in a test.
  "$VENV/bin/python" -W ignore -c 'import sglang.srt.layers.quantization.compressed_tensors.compressed_tensors' >&2
  touch "$VENV/.kq-ready"
  log "built in $((SECONDS - start)) s"
fi

# kq itself: editable, pointing at the calling checkout. Reinstall only when the venv
# points elsewhere (another clone). -I: the calling folder may hold a stale kq.egg-info.
current=$("$VENV/bin/python" -I - <<'PYEOF'
import json
from importlib import metadata
try:
    print(json.loads(metadata.distribution("kq").read_text("direct_url.json"))["url"])
except Exception:
    print("")
PYEOF
)
if [ "$current" != "file://$REPO" ]; then
  log "installing kq from $REPO (editable, no deps)"
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$REPO" >&2
fi

echo "$VENV"

#!/usr/bin/env bash
# Per-rank expert load on this CPU machine, trained tiny model: benchmarks/sglang_check.py --cpu-dry in the
# SGLang side venv (`bash .ci/sglang-venv.sh` builds it; setup.sh does too). It quantizes the trained
# tiny model (shared/models/tiny-glm-5.2-fp8), cuts `kq shard --tp 8` rank files, builds SGLang's FusedMoE
# with kq's config and with SGLang's own compressed-tensors config through SGLang's loader (same rank
# slice; the layer takes the rank file and its weights = prepack of what SGLang loaded), and times one rank's expert load from the rank file vs
# from the unsharded checkpoint (page cache dropped first). The "kq us" column of a dry run is kq's torch
# path on the CPU, not a kernel time. Table to stdout and $OUT/sglang_load_cpu.txt (OUT default: out).
set -euo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
VENV=$(bash .ci/sglang-venv.sh --path)
PY=$VENV/bin/python
[ -x "$PY" ] || { echo "no SGLang side venv at $VENV: run \`bash .ci/sglang-venv.sh\` first"; exit 2; }
WORK=${WORK:-$(mktemp -d)}
{
  echo "# bash benchmarks/sglang_load_cpu.sh: $(date -u '+%F %H:%M UTC'), kq $(git describe --always --dirty), $(nproc) CPUs, $(uname -m)"
  PYTHONPATH=$PWD "$PY" benchmarks/sglang_check.py --cpu-dry --work "$WORK" --out "$OUT" 2>&1 \
    | grep -v "^\[" | grep -v "^ \|^Traceback"
} | tee "$OUT/sglang_load_cpu.txt"

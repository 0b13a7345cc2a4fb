#!/usr/bin/env bash
# On the lent H200, from the repo root: issue #4's quality table (benchmarks/quality.py, groups 32 and 128, every
# row: kq GPTQ + its variants on cuda, kq RTN, naive absmax, llm-compressor oneshot GPTQ on cuda and model_free_ptq)
# in one call, then (GPTQ_LAYER=1) the full-size GLM-5.2 layer timing. Table, JSON and logs land in $OUT.
#
# Here, first (copies the tiny model + both texts into the git-ignored .carry-quality/, 20-odd MB):
#   .venv/bin/python benchmarks/quality.py --prepare
# Then the GPU call:  bash benchmarks/gpu_quality.sh     carry: .carry-quality .whl-rtn
#   (.whl-rtn: llm-compressor 0.14 and the wheels the image lacks, see benchmarks/gpu_rtn.sh --download)
# Knobs: DEADLINE_S (no quantization starts after it; default 300), GRACE_S (wait for evaluations; 60),
#   EVAL_JOBS (CPU evaluation processes; 3), ONLY (row keys, see quality.py --only), QGROUPS (32,128),
#   SAMPLES/SEQLEN (calibration, 512 x 512), GPTQ_LAYER=1 (also benchmarks/gptq_layer_gpu.py after the table,
#   LAYER_DEADLINE_S 240), LAYER_ONLY=1 (only the layer timing), WORK (scratch, /tmp/kq-quality).
# KQ_BENCH_DRY=1 rehearses the logic on this CPU machine: ../shared, device cpu, .venv / .venv-llmc,
#   4 x 64 calibration tokens, group 32, wheels only unpacked (checked to install).
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
WORK=${WORK:-/tmp/kq-quality}
DEADLINE_S=${DEADLINE_S:-300}
GRACE_S=${GRACE_S:-60}
EVAL_JOBS=${EVAL_JOBS:-3}
GROUPS_=${QGROUPS:-32,128}
SAMPLES=${SAMPLES:-512}
SEQLEN=${SEQLEN:-512}
SITE=/tmp/site
if [ -n "$KQ_BENCH_DRY" ]; then
  PY=.venv/bin/python; LLMC_PY=.venv-llmc/bin/python; DEV=cpu; SITE=/tmp/site-dry; SHARED=../shared
  SAMPLES=4; SEQLEN=64; GROUPS_=${QGROUPS:-32}; EVAL_JOBS=${EVAL_JOBS_DRY:-1}
  LAYER_ARGS=(--tiny --device cpu --samples 2 --seqlen 64 --group 32 --expert-chunk 4 --project-samples 16)
  PIPX=(--python-version 3.12 --implementation cp --only-binary=:all:
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
else
  PY=python3; LLMC_PY=python3; DEV=cuda; SHARED=.carry-quality; PIPX=(); LAYER_ARGS=()
  [ -f "$SHARED/models/tiny-glm-5.2-fp8/config.json" ] || { echo "no $SHARED: run 'python benchmarks/quality.py --prepare' here and carry .carry-quality"; exit 2; }
fi
{ date -u; nproc; free -g | head -2; cat "$SHARED/COMMIT" 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null; } | tee "$OUT/machine.txt"
rc=0
if [ -z "$LAYER_ONLY" ]; then
  rm -rf "$SITE"
  if ls .whl-rtn/*.whl > /dev/null 2>&1 && "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
       --upgrade "${PIPX[@]}" --target "$SITE" .whl-rtn/*.whl; then
    [ -z "$KQ_BENCH_DRY" ] && export PYTHONPATH=$SITE:$PWD
  else
    echo "wheels in .whl-rtn did not install: llm-compressor rows will fail (carry .whl-rtn)"
  fi
  export KQ_LLMC_PYTHON=$LLMC_PY
  SKIP=()
  if ! "$LLMC_PY" -c "from llmcompressor import oneshot, model_free_ptq" > "$OUT/llmc_import.log" 2>&1; then
    echo "llm-compressor does not import (tail of $OUT/llmc_import.log):"; tail -5 "$OUT/llmc_import.log"; SKIP=(--skip-llmc)
  fi
  "$PY" benchmarks/quality.py --shared "$SHARED" --groups "$GROUPS_" --samples "$SAMPLES" --seqlen "$SEQLEN" \
    --device "$DEV" --eval-jobs "$EVAL_JOBS" --deadline-s "$DEADLINE_S" --grace-s "$GRACE_S" --work "$WORK" \
    --out "$OUT/quality.md" ${ONLY:+--only "$ONLY"} "${SKIP[@]}" 2>&1 | tee "$OUT/quality.log"
  rc=$?
  cp "$WORK/quality.json" "$OUT/" 2>/dev/null
  [ -f "$OUT/quality.md" ] && { echo; cat "$OUT/quality.md"; }
fi
if [ -n "$GPTQ_LAYER" ] || [ -n "$LAYER_ONLY" ]; then
  "$PY" benchmarks/gptq_layer_gpu.py --work /tmp/kq-gptq-layer --deadline-s "${LAYER_DEADLINE_S:-240}" \
    "${LAYER_ARGS[@]}" 2>&1 | tee "$OUT/gptq_layer.log"
  rc2=$?; [ $rc -eq 0 ] && rc=$rc2
  tail -1 "$OUT/gptq_layer.log" > "$OUT/gptq_layer.json"
  rm -rf /tmp/kq-gptq-layer
fi
[ -z "$LAYER_ONLY" ] && rm -rf "$WORK/"*-g* "$WORK/bf16"  # only what this run made (a LAYER_ONLY run beside it shares nothing)
exit $rc

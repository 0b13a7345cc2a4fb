#!/usr/bin/env bash
# On the lent H200, from the repo root: issue 5 point 5 — kq's SGLang plugin MoE method vs the torch
# reference and SGLang's own Marlin MoE (CompressedTensorsWNA16MoE) on the same loaded weights and
# routing (rsf 2.5), and per-rank load time of `kq shard` files vs the unsharded checkpoint, on a
# generated tiny GLM-5.2-layout model and one generated full-size GLM-5.2 layer
# (benchmarks/sglang_check.py; its docstring says what is compared and the tolerances).
#
# Carry (git-ignored): .whl (sglang 0.5.23 + small deps, see gpu_kernels.sh, plus openai 2.8.0, distro, jiter,
# sniffio and partial-json-parser: SGLang's FusedMoE import chain reaches its OpenAI protocol module and the
# image lacks them (checked against KINDS.md's package list); KQ_WHL=.whl-slim names a copy
# whose sglang wheel lacks the Rust server extensions and test folders, 25 MB instead of 46) and .gpu
# (stubs/IPython, stubs/sgl_kernel/{__init__,scalar_type}.py, peer_moe_bench.py, ct/: compressed-tensors
# 0.18.0 and loguru wheels).
# Whole run < 10 min wall (TOTAL_S, default 580, under the device call limit of 600 s): SGLang's Marlin
# JIT build runs in the background from the start (`--warm-marlin` builds its two Marlin MoE variants
# and the repack module in parallel: 363 s on the H200 machine, 2026-11-30) while the checkpoints are
# generated, quantized and sharded, and the kq-only rows and load timings run; the Marlin comparison
# runs after it, within what is left. The run that completed: TOTAL_S=580, 436 s wall.
# The JIT build lands in SGLang's JIT cache, $SGLANG_JIT_CACHE_DIR (default ~/.cache/sglang/jit),
# plus Triton's ~/.triton/cache: a later script on the same machine (e.g. gpu_kernels.sh MARLIN=1)
# reuses it as long as it runs with the same HOME / SGLANG_JIT_CACHE_DIR and the machine is warm.
# Outputs in $OUT: gpu_sglang.md (table), gpu_check.json (Marlin run), kq_only/gpu_check.json
# (kq rows + load timings), logs.
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT" "$OUT/kq_only"
export PYTHONUNBUFFERED=1
TOTAL_S=${TOTAL_S:-580}
WORK=${WORK:-/tmp/kq-gpu-check}
TOKENS=${TOKENS:-1,16,64}
left() { echo $((TOTAL_S - SECONDS)); }
lim() { local n=$(( TOTAL_S - SECONDS - $1 )); [ "$n" -lt 10 ] && n=10; echo "$n"; }  # timeout 0 = none

# .gpu/ct: compressed-tensors 0.18.0 (SGLang 0.5.23's pin) + loguru; SGLang's compressed-tensors config imports it.
SITE=${SGL_SITE:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${KQ_WHL:-.whl}"/*.whl \
  .gpu/ct/*.whl || { echo "wheel install failed"; exit 1; }
# The sgl_kernel stand-in (placeholders for the compiled ops SGLang imports on CUDA; see its docstring).
cp tests/sglang/stubs/sgl_kernel/__init__.py .gpu/stubs/sgl_kernel/__init__.py || exit 1
export PYTHONPATH=$SITE:$PWD/.gpu/stubs:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
echo "JIT cache: ${SGLANG_JIT_CACHE_DIR:-$HOME/.cache/sglang/jit}" | tee -a "$OUT/gpu.txt"

echo "== [$SECONDS s] Marlin JIT warm-up (background)"
timeout "$(lim 75)" python3 benchmarks/sglang_check.py --warm-marlin > "$OUT/marlin_warm.log" 2>&1 &
WARM=$!

echo "== [$SECONDS s] checkpoints: generate, kq quantize, kq shard --tp 8"
timeout "$(lim 150)" python3 benchmarks/sglang_check.py --full --prepare-only --work "$WORK" 2>&1 \
  | tee "$OUT/prepare.log" | grep -v "^\[" | tail -4

echo "== [$SECONDS s] kq rows + load timings (no Marlin)"
timeout "$(lim 110)" python3 benchmarks/sglang_check.py --full --no-marlin --tokens "$TOKENS" --work "$WORK" \
  --out "$OUT/kq_only" > "$OUT/kq_only.log" 2>&1
echo "rc $?"; grep -v "^\[" "$OUT/kq_only.log" | grep -v "^ \|^Traceback" | tail -25

echo "== [$SECONDS s] waiting for the Marlin warm-up (at most $(( $(left) - 75 )) s)"
MARLIN=1
while kill -0 "$WARM" 2>/dev/null; do
  if [ "$(left)" -le 75 ]; then kill "$WARM" 2>/dev/null; MARLIN=; echo "warm-up not done: stopped"; break; fi
  sleep 5
done
wait "$WARM" 2>/dev/null; rc=$?
tail -2 "$OUT/marlin_warm.log"
# A failed (not stopped) warm-up: the Marlin step still runs and reports its own error.
[ "$rc" = 0 ] || echo "warm-up rc $rc (see marlin_warm.log)"

if [ -n "$MARLIN" ]; then
  echo "== [$SECONDS s] kq vs SGLang Marlin MoE vs torch reference ($(left) s left)"
  timeout "$(lim 5)" python3 benchmarks/sglang_check.py --full --no-load --tokens "$TOKENS" --work "$WORK" \
    --out "$OUT" > "$OUT/marlin.log" 2>&1
  echo "rc $?"; grep -v "^\[" "$OUT/marlin.log" | grep -v "^ \|^Traceback" | tail -25
fi
{
  echo "# kq SGLang plugin on $(head -2 "$OUT/gpu.txt" | tail -1) — $(date -u '+%F %H:%M UTC')"
  echo; echo '## kq only + load timings'; echo '```'; grep -v "^\[" "$OUT/kq_only.log" | grep -v "^ \|^Traceback"; echo '```'
  if [ -f "$OUT/marlin.log" ]; then
    echo; echo '## with SGLang Marlin'; echo '```'; grep -v "^\[" "$OUT/marlin.log" | grep -v "^ \|^Traceback"; echo '```'
  fi
} > "$OUT/gpu_sglang.md"
echo "== done in $SECONDS s; $OUT/gpu_sglang.md"

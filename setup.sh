#!/usr/bin/env bash
# One-time set-up on a fresh machine: the main venv (.venv, CPU torch 2.13.0 from the
# local wheel, kq editable with its test and eval extras) and the SGLang side venv used by the
# SGLang tests (cached under ~/.cache/kq, see .ci/sglang-venv.sh). Idempotent.
set -euo pipefail
cd "$(dirname "$0")"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c .ci/constraints.txt -e '.[test,eval]'
bash .ci/sglang-venv.sh >/dev/null
echo "set-up done: activate with '. .venv/bin/activate'" >&2

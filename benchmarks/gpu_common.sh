# Sourced by the one-GPU scripts (gpu_one.sh, gpu_record.sh): results folder $R = $OUT/$1, the
# SGLang wheels from .whl-slim installed into /tmp/site-$1 and put on PYTHONPATH with the stubs in
# .gpu/stubs, the GPU's name, driver and clocks into $R/gpu.txt; T0 = the start, for elapsed times;
# kernel_tests and decode_rows, the steps both scripts run; lanes_ab, a benchmarks/lanes_ab.py run with its
# summary table (ab_table).
set -o pipefail
OUT=${OUT:-out}; R=$OUT/$1; mkdir -p "$R"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/kq_ext
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/site-$1" .whl-slim/*.whl
export PYTHONPATH=/tmp/site-$1:$PWD/.gpu/stubs:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$R/gpu.txt"

# GPU tests into $R/$1.log (default pytest_gpu), the arguments after $1 going to pytest (default: both
# kernel test files); TEST_TIMEOUT (default 170 s)
kernel_tests() {
  local log=${1:-pytest_gpu}; shift $(( $# > 0 ))
  [ $# -gt 0 ] || set -- tests/test_kernels_gpu.py tests/test_kernels_lanes_gpu.py
  timeout "${TEST_TIMEOUT:-170}" python3 -m pytest -q -p no:cacheprovider -m gpu "$@" > "$R/$log.log" 2>&1
  tail -1 "$R/$log.log"; grep FAILED "$R/$log.log" | head
  echo "$log done after $(( $(date +%s) - T0 )) s"
}

# bench_kernels.py --lanes against cuBLAS and SGLang's FP8 MoE at 1/16/64 tokens, groups 128 and 32, with
# the dense rows, into $R/decode.log; MOE names the MoE shapes (bench_kernels.MOE_SHAPES, default
# all four of #3: glm52,kimi_tp8,kimi,glm47; about 130 s on the H200 with the dense rows)
decode_rows() {
  timeout "${DECODE_TIMEOUT:-260}" python3 benchmarks/bench_kernels.py --out "$R" --lanes --peers dense,fp8 \
    --moe "${MOE:-glm52,kimi_tp8,kimi,glm47}" --tokens 1,16,64 --groups 128,32 --dense-m "${DENSE_M:-1,8,16,64,4096}" > "$R/decode.log" 2>&1
  echo "decode rc $? after $(( $(date +%s) - T0 )) s"
}

# benchmarks/lanes_ab.py's rows ($1, JSON lines) as a table: per case and stage the best time of each
# variant and its speed-up over base, then any output that differed from base's
ab_table() {
  python3 - "$1" <<'PY'
import json, sys, collections
t = collections.defaultdict(list); same = {}
for l in open(sys.argv[1]):
    r = json.loads(l); t[(r["case"], r["stage"], r["variant"])].append(r["us"])
    if r["same_as_base"] is False: same[(r["case"], r["stage"], r["variant"])] = False
vs = list(dict.fromkeys(k[2] for k in t))
print("case stage " + " ".join(vs))
for c, s in dict.fromkeys((k[0], k[1]) for k in t):
    b = min(t[(c, s, "base")])
    print(c, s, " ".join(f"{min(t[(c, s, v)]):.1f}({b / min(t[(c, s, v)]):.3f})" for v in vs))
print("outputs differing from base:", same or "none")
PY
}

# benchmarks/lanes_ab.py into $R/$1.jsonl (stderr $R/$1.err; AB_TIMEOUT, default 300 s), then its table;
# the arguments after $1 go to lanes_ab.py
lanes_ab() {
  local f=$1; shift
  timeout "${AB_TIMEOUT:-300}" python3 benchmarks/lanes_ab.py "$@" > "$R/$f.jsonl" 2> "$R/$f.err"
  echo "$f rc $? after $(( $(date +%s) - T0 )) s"; tail -3 "$R/$f.err"
  ab_table "$R/$f.jsonl"
}

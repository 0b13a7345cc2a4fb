#!/usr/bin/env bash
# One lent H200 (nvidia-h200), one call, the eighth and ninth sessions' probes; STEPS picks them (default:
# the eighth's five):
#  tests   the lane kernel's dense GPU tests (the XPRE instances among them);
#  ab      benchmarks/lanes_ab.py with AB_VARIANTS (default base) on the cases AB_CASES (default g32), AB_ROUNDS rounds;
#  dense   lanes_ab: every dense instance on 12288x6144 and 4096x7168 at M = DENSE_M (default 1,2,8);
#  tiles   benchmarks/dense_tiles_probe.py at M = 64 (Triton tile configs, tiles layout);
#  nov3    the same with DISABLE_MMA_V3=1 (Triton's mma.sync at 64-row tiles; a probe, not a setting);
#  floor   benchmarks/read_floor.py (one kernel reading the dense rows' bytes);
#  swaptests  tests/test_kernels_gpu.py (swap_kernel's tests and the dense defaults that now take it);
#  swap    benchmarks/dense_swap_probe.py (swap_kernel's tile configs against cuBLAS, SWAP_NK its cases);
#  ncuswap Nsight Compute on swap_kernel's default config at 48 and 64 rows (benchmarks/ncu_swap.py).
# Tenth session:
#  lanestests  all of tests/test_kernels_lanes_gpu.py;
#  moeinst every MoE instance of both stages (lanes_ab --all-instances, two rounds) on lanes_ab's MoE cases
#          (MOEINST_CASES, default glm52,kimi), variants MOEINST_VARIANTS (lanes_ab.py DEFINES, default base),
#          stages MOEINST_STAGES (default gate_up,down).
# carry: .whl-slim .gpu        results: $OUT/probe.tgz
source benchmarks/gpu_common.sh probe
export MAX_JOBS=16
STEPS=${STEPS:-tests,dense,tiles,nov3,floor}
export AB_TIMEOUT=${AB_TIMEOUT:-200}     # for lanes_ab (gpu_common.sh)
has() { [[ ",$STEPS," == *",$1,"* ]]; }
if has tests || has ab || has dense || has lanestests || has moeinst; then
  python3 -c "from kq.kernels import cuda_lanes; cuda_lanes._ext()" && echo "ext built after $(( $(date +%s) - T0 )) s"
fi
has swaptests && TEST_TIMEOUT=200 kernel_tests pytest_swap tests/test_kernels_gpu.py
if has swap; then
  timeout "${SWAP_TIMEOUT:-330}" python3 benchmarks/dense_swap_probe.py ${SWAP_NK:+--nk "$SWAP_NK"} \
    > "$R/swap.jsonl" 2> "$R/swap.err"
  echo "swap rc $? after $(( $(date +%s) - T0 )) s"; tail -3 "$R/swap.err"; grep -v '^{' "$R/swap.jsonl"
fi
if has ncuswap; then
  timeout "${NCU_TIMEOUT:-150}" ncu --clock-control none -k regex:w4a16_swap_kernel --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis python3 benchmarks/ncu_swap.py > "$R/ncu_swap.log" 2>&1
  echo "ncuswap rc $? after $(( $(date +%s) - T0 )) s"
  grep -E "^  [a-z_0-9]+.*w4a16|M = |Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Stall|Dynamic Shared" "$R/ncu_swap.log" | head -80
fi
has tests && TEST_TIMEOUT=150 kernel_tests pytest_dense tests/test_kernels_lanes_gpu.py -k "dense or linear"
has lanestests && TEST_TIMEOUT=${TEST_TIMEOUT:-200} kernel_tests pytest_lanes tests/test_kernels_lanes_gpu.py
has moeinst && lanes_ab moeinst --variants "${MOEINST_VARIANTS:-base}" --all-instances --cases "${MOEINST_CASES:-glm52,kimi}" \
  --stages "${MOEINST_STAGES:-gate_up,down}"
has ab && lanes_ab ab --variants "${AB_VARIANTS:-base}" --cases "${AB_CASES:-g32}" ${AB_ROUNDS:+--rounds "$AB_ROUNDS"}
has dense && lanes_ab ab_dense --variants base --all-instances --cases dense --dense-m "${DENSE_M:-1,2,8}"
tiles() {   # $1 = file stem; the environment picks Triton's MMA
  timeout 150 python3 benchmarks/dense_tiles_probe.py --m 64 > "$R/$1.jsonl" 2> "$R/$1.err"
  echo "$1 rc $? after $(( $(date +%s) - T0 )) s"; tail -2 "$R/$1.err"
  python3 -c "
import json
for l in open('$R/$1.jsonl'):
    r = json.loads(l); c = r.get('cfg', {})
    print(r['M'], r.get('kind', '?'), *(c.get(f) for f in ('block_m', 'block_n', 'split_k', 'num_warps', 'num_stages')),
          r.get('us', r.get('error', '')[:80]), r.get('rel_to_default', ''))"
}
has tiles && tiles tiles64
has nov3 && DISABLE_MMA_V3=1 TRITON_CACHE_DIR=/tmp/triton_nov3 tiles tiles64_nov3
if has floor; then
  timeout 150 python3 benchmarks/read_floor.py > "$R/floor.jsonl" 2> "$R/floor.err"
  echo "floor rc $? after $(( $(date +%s) - T0 )) s"; tail -2 "$R/floor.err"; grep -E '"best"|empty' "$R/floor.jsonl"
fi
tar czf "$OUT/probe.tgz" -C "$OUT" probe && rm -rf "$R"

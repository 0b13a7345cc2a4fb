#!/usr/bin/env bash
# One lent H200 (nvidia-h200), one call: benchmarks/lanes_ab.py (compile-time variants of the CUDA lane
# kernel A/B'd on the decode cases that miss #3's targets), then Nsight Compute with source-level stall
# sampling on the base build's picked instances (NCU_CASES, benchmarks/ncu_lanes.py --cases).
# carry: .whl-slim .gpu        results: $OUT/ab.tgz
source benchmarks/gpu_common.sh ab
export MAX_JOBS=16
lanes_ab ab --variants "${AB_VARIANTS:-base}" ${AB_ARGS:-}
if [ -n "${NCU_CASES:-}" ]; then
  timeout "${NCU_TIMEOUT:-150}" ncu --clock-control none -k regex:moe_lanes_kernel --import-source no \
    --section WarpStateStats --section SourceCounters --section SpeedOfLight -o "$R/src" \
    python3 benchmarks/ncu_lanes.py --cases "$NCU_CASES" > "$R/ncu_run.log" 2>&1
  echo "ncu rc $?"
  ncu -i "$R/src.ncu-rep" --page raw --csv > "$R/ncu_raw.csv" 2>&1
  ncu -i "$R/src.ncu-rep" --page source --print-source sass --csv > "$R/ncu_sass.csv" 2>&1
  echo "ncu pages rc $?"; ls -la "$R"
  rm -f "$R/src.ncu-rep"
fi
tar czf "$OUT/ab.tgz" -C "$OUT" ab && rm -rf "$R"

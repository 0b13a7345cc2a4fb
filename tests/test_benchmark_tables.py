"""BENCHMARKS.md's table of record for #3 is what benchmarks/kernel_table.py and benchmarks/bound_table.py
print from the committed rows (benchmarks/results/h200): every row of their tables appears in it verbatim."""
import contextlib
import io
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RES = ROOT / "benchmarks" / "results" / "h200"
DECODE = RES / "kernels_s12_decode_a1f86d7_call4.jsonl"
MARLIN = RES / "kernels_s12_marlin_a1f86d7_call4.json"
PROBES = (RES / "lanes_ab_s11_call5_probe_4cb0706.jsonl", RES / "lanes_ab_s12_call6_probe_b19727f.jsonl")


def _printed(module: str, *args: str) -> list[str]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        mod = __import__(module)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            mod.main(list(args))
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return [line for line in out.getvalue().splitlines() if line.startswith("| ") and not line.startswith("| case")
            and not line.startswith("| dense N")]


@pytest.mark.parametrize("module,args", [("kernel_table", (str(DECODE), str(MARLIN))),
                                         ("bound_table", (str(DECODE), *map(str, PROBES)))])
def test_the_table_of_record_is_what_the_scripts_print(module, args):
    rows = _printed(module, *args)
    assert len(rows) >= 8
    text = (ROOT / "BENCHMARKS.md").read_text()
    missing = [r for r in rows if r not in text]
    assert not missing, missing

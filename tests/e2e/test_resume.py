"""Kill -9 at several points, rerun the same command: the result is byte-identical to an
uninterrupted run, and no half-written file is ever presented as finished."""
import subprocess
import sys
from pathlib import Path

import pytest

from kq_testutil import run_kq

KILLER = Path(__file__).resolve().parents[1] / "_killed_run.py"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("point", ["expert:5", "shard:1", "shard:2", "finish"])
def test_kill_and_resume_is_byte_identical(tmp_path, small_glm5, small_glm5_out, point):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(KILLER), str(small_glm5), str(out), "32", point],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == -9, (r.returncode, r.stdout, r.stderr)
    # killed: no manifest, so verify refuses it and says how to finish
    assert not (out / "kq-manifest.json").exists()
    v = run_kq("verify", out)
    assert v.returncode == 2 and "unfinished run" in v.stderr
    assert not any(p.name.endswith(".safetensors") and (out / (p.name + ".tmp")).exists() for p in out.iterdir())
    r = run_kq("quantize", small_glm5, "--out", out, "--group-size", "32", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    if point.startswith("shard"):
        assert "already written, skipped (resume)" in r.stderr
    assert _files(out) == _files(small_glm5_out)
    assert not (out / ".kq-work").exists()

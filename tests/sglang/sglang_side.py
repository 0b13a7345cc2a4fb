"""Helpers for the SGLang tests: the side venv, kq outputs of every family, and SGLang's own
answers about them (tests/sglang/probe_config.py run in the side venv).

The side venv is built by `.ci/sglang-venv.sh` (cached under ~/.cache/kq). When it is missing
the tests fail with the command to run; KQ_SKIP_SGLANG=1 skips them instead.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SMALL = dict(hidden=128, n_experts=4, moe_intermediate=128, num_layers=3, vocab=512, intermediate=256)
# Expert counts of the real models: SGLang's shared-expert fusion decision depends on them.
REAL_EXPERTS = {"glm5": 256, "glm4_moe": 160, "kimi_k2": 384}
GROUP = 32


def side_python() -> Path:
    if os.environ.get("KQ_SKIP_SGLANG") == "1":
        pytest.skip("KQ_SKIP_SGLANG=1")
    r = subprocess.run(["bash", str(REPO / ".ci" / "sglang-venv.sh"), "--path"], capture_output=True, text=True)
    venv = Path(r.stdout.strip())
    if r.returncode != 0 or not (venv / ".kq-ready").is_file():
        pytest.fail(f"SGLang side venv missing at {venv}: run `bash .ci/sglang-venv.sh` once "
                    "(about 8 minutes), or set KQ_SKIP_SGLANG=1 to skip the SGLang tests", pytrace=False)
    return venv / "bin" / "python"


def run_side(script: Path, *args, timeout=900) -> subprocess.CompletedProcess:
    """Run a script in the side venv with this checkout's kq first on the path (the venv's
    editable install may point at another clone)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([str(side_python()), str(script), *map(str, args)], capture_output=True, text=True,
                       env=env, cwd=str(REPO), timeout=timeout)
    if r.returncode != 0:
        pytest.fail(f"{script.name} failed in the SGLang side venv (rc {r.returncode}):\n{r.stderr[-4000:]}",
                    pytrace=False)
    return r


def run_probe(jobs: list[dict], tmp: Path, plugins: bool = False) -> list[dict]:
    jobs_file, out = tmp / "jobs.json", tmp / "probe.json"
    jobs_file.write_text(json.dumps(jobs))
    run_side(HERE / "probe_config.py", "--jobs", jobs_file, "--out", out, *(["--plugins"] if plugins else []))
    return json.loads(out.read_text())


def quantize(family: str, root: Path) -> Path:
    from kq.synth import generate

    src = generate(family, root / f"{family}-src", seed=1, **SMALL)
    out = root / f"{family}-int4"
    r = subprocess.run([sys.executable, "-m", "kq", "quantize", str(src), "--out", str(out), "--group-size",
                        str(GROUP), "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return out


def with_real_expert_count(out: Path, family: str, dst: Path) -> Path:
    """A folder holding only out's config.json with the real model's routed-expert count (the
    probe reads config.json only; SGLang's fusion rule looks at n_routed_experts)."""
    cfg = json.loads((out / "config.json").read_text())
    cfg["n_routed_experts"] = REAL_EXPERTS[family]
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst

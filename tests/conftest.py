"""Shared fixtures: small generated checkpoints and their kq outputs, built once per session."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
TINY_MODEL = SHARED / "models" / "tiny-glm-5.2-fp8"

# A small GLM-5.2-layout checkpoint: 3 layers + MTP, 4 experts, fast to quantize on 2 cores.
SMALL_GLM5 = dict(hidden=128, n_experts=4, moe_intermediate=128, num_layers=3, vocab=512, intermediate=256)


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the lent H200, not in CI)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_kq(*args, env=None, cwd=None, timeout=600):
    """The real CLI in a subprocess: what a user sees (stdout, stderr, exit code)."""
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "kq", *map(str, args)], capture_output=True, text=True,
                          env=e, cwd=cwd, timeout=timeout)


@pytest.fixture(scope="session")
def small_glm5(tmp_path_factory) -> Path:
    from kq.synth import generate
    d = tmp_path_factory.mktemp("src") / "glm5-small"
    generate("glm5", d, seed=1, **SMALL_GLM5)
    return d


@pytest.fixture(scope="session")
def small_glm5_out(tmp_path_factory, small_glm5) -> Path:
    """kq's output for small_glm5 at group 32 (default MSE clipping)."""
    out = tmp_path_factory.mktemp("out") / "glm5-small-int4"
    r = run_kq("quantize", small_glm5, "--out", out, "--group-size", "32", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    return out


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst

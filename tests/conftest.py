"""Shared fixtures: small generated checkpoints and their kq outputs, built once per session."""
from __future__ import annotations

from pathlib import Path

import pytest

from kq_testutil import SMALL_GLM5, run_kq


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the lent H200, not in CI)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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

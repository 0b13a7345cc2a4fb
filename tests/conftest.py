"""Shared fixtures: small generated checkpoints and their kq outputs, built once per session."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

# Without a GPU, kq's Triton kernels can only run under Triton's interpreter, and the shim that
# sets it up must be the first thing in the process to import Triton (compressed-tensors and
# others import it too): load it before any test module is collected.
if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    import _triton_interpreter  # noqa: F401,E402

from kq_testutil import SMALL_GLM5, run_kq  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
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


@pytest.fixture(scope="session")
def trained_output(tmp_path_factory):
    """kq quantize of the trained tiny model, one run per (group, clip), shared by the tests."""
    from kq_testutil import TINY_MODEL
    made: dict[tuple[int, str], Path] = {}

    def get(group: int, clip: str = "mse") -> Path:
        if (group, clip) not in made:
            out = tmp_path_factory.mktemp(f"trained-g{group}-{clip}") / "out"
            r = run_kq("quantize", TINY_MODEL, "--out", out, "--group-size", group, "--clip", clip,
                       "--device", "cpu", "--json")
            assert r.returncode == 0, r.stderr
            made[(group, clip)] = out
        return made[(group, clip)]
    return get


@pytest.fixture(scope="session")
def real_slices(tmp_path_factory):
    """Each real layout's slice (tests/real_layouts.py slice_spec), quantized by the CLI (absmax RTN,
    the family's default group) on the CPU; built on first use."""
    import json

    import real_layouts
    got = {}

    def get(model):
        if model not in got:
            root = tmp_path_factory.mktemp(f"slice-{model}")
            src, written = real_layouts.build_slice(model, root / "src")
            out = root / "out"
            r = run_kq("quantize", src, "--out", out, "--device", "cpu", "--clip", "absmax", "--tp", "8", "--json",
                       timeout=1800)
            assert r.returncode == 0, r.stderr
            got[model] = (src, out, json.loads(r.stdout), written)
        return got[model]
    return get

"""SGLang 0.5.23 loads the FP8 KV-cache scales of `kq quantize --kv-cache fp8` (its own code, side venv)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from sglang_side import GROUP, HERE, SMALL, run_side

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_sglang_loads_every_layers_scale(tmp_path):
    from kq.synth import generate
    from kq_testutil import SHARED
    src = generate("glm5", tmp_path / "src", seed=1, **SMALL)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "kq", "quantize", str(src), "--out", str(out), "--group-size", str(GROUP),
                        "--device", "cpu", "--kv-cache", "fp8", "--calib", str(SHARED / "data" / "calibration_text.txt.gz"),
                        "--calib-samples", "2", "--calib-seqlen", "32"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    run_side(HERE / "check_kv_scales.py", out, "--out", tmp_path / "r.json")
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["kv_cache_quant_algo"] == "FP8"   # --kv-cache-dtype auto then picks the FP8 pool
    assert res["unused"] == []
    t = load_file(str(out / "kq-kv-scales.safetensors"))
    for i in range(SMALL["num_layers"]):
        row = res["layers"][str(i)]
        assert row["method"] == "CompressedTensorsKVCacheMethod"
        assert row["loaded"] == [f"model.layers.{i}.self_attn.attn_mqa.k_scale", f"model.layers.{i}.self_attn.attn_mqa.v_scale"]
        want = float(t[f"model.layers.{i}.self_attn.attn_mqa.k_scale"])
        assert row["k_scale_float"] == row["v_scale_float"] == pytest.approx(want, rel=1e-7)

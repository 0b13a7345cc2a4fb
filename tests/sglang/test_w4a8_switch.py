"""kq's MoE method switches to the W4A8 kernel at prefill sizes when the checkpoint's INT4 group says
dynamic FP8 activations (issue 21, item 3), through SGLang's own FusedMoE layer and weight loader in the
side venv (tests/sglang/check_w4a8_switch.py); the predicate on compressed-tensors' own QuantizationArgs."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_side import HERE, run_side

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

FP8_TOKEN = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}


@pytest.fixture(scope="module")
def fp8_act_ckpt(tmp_path_factory):
    """A GLM-5.2-layout kq checkpoint at group 128 whose INT4 group declares dynamic per-token FP8
    input activations (the config `kq quantize --activations fp8` writes; issue 21 item 1)."""
    from kq.synth import generate

    root = tmp_path_factory.mktemp("w4a8")
    src = generate("glm5", root / "src", seed=3, hidden=128, n_experts=4, moe_intermediate=128, num_layers=3,
                   vocab=512, intermediate=256)
    out = root / "int4"
    r = subprocess.run([sys.executable, "-m", "kq", "quantize", str(src), "--out", str(out), "--group-size", "128",
                        "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["int4_experts"]["input_activations"] = FP8_TOKEN
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def switch(fp8_act_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("sw") / "switch.json"
    run_side(HERE / "check_w4a8_switch.py", fp8_act_ckpt, "--out", out)
    return json.loads(out.read_text())


def test_fp8_activation_checkpoint_goes_to_kq_with_the_flag(switch):
    assert switch["method"] == "KqMoEMethod" and switch["fp8_activations"] is True
    assert switch["lane"] is True
    assert switch["scales_on_cpu"] is False          # the W4A8 kernel needs a Hopper GPU: no scales made here


def test_below_the_threshold_the_w4a16_path_runs(switch):
    r = switch["below"]
    assert r["uses_w4a8"] is False
    assert r["err_vs_w4a16"] < 1e-6
    assert r["w4a8_vs_w4a16"] > 1e-3                 # the two paths are told apart


def test_above_the_threshold_the_w4a8_path_runs(switch):
    r = switch["above"]
    assert r["uses_w4a8"] is True
    assert r["err_vs_w4a8_reference"] < 1e-6
    assert r["err_vs_w4a16"] > 1e-3


def test_predicate_on_compressed_tensors_args(switch):
    assert switch["predicate"] == {"fp8_dynamic_token": True, "fp8_dynamic_group": True, "fp8_static": False,
                                   "int8_dynamic": False, "none": False}

"""A W4AFP8 kq checkpoint (`--activations fp8`, or `kq config` of a W4A16 one) as SGLang 0.5.23
reads it, through its own code in the side venv (probe_config.py; Hopper simulated).

What SGLang does with it, pinned here so a change in SGLang shows up:
- scheme selection: the routed experts pick CompressedTensorsW4AFP8MoE (the INT4 group's
  input_activations are 8-bit dynamic float), the FP8 linears keep CompressedTensorsW8A8Fp8
  with the source's block;
- but CompressedTensorsW4AFP8MoE takes num_bits and group_size from the config group that
  targets `Linear` (kq's FP8 group), not from the experts' own group, so building the expert
  weights fails: stock SGLang 0.5.23 cannot serve it with --quantization compressed-tensors;
- with kq's plugin (default launch line) the experts go to kq's MoE method, which says it
  says what it computes for a checkpoint that asks for FP8 activations (W4A8 at prefill sizes,
  W4A16 below).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_side import SMALL, run_probe
from test_config_acceptance import FP8_BLOCK, MODEL_CLASS, _models, _modules

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

FAMILIES = list(MODEL_CLASS)


def _kq(*args):
    r = subprocess.run([sys.executable, "-m", "kq", *map(str, args)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """{(family, "w4a16" | "w4afp8")}: a group-128 kq output of each family and its `kq config` twin."""
    from kq.synth import generate

    root = tmp_path_factory.mktemp("w4afp8")
    out = {}
    for fam in FAMILIES:
        src = generate(fam, root / f"{fam}-src", seed=1, **SMALL)
        a = root / f"{fam}-w4a16"
        _kq("quantize", src, "--out", a, "--group-size", 128, "--device", "cpu")
        _kq("config", a, "--activations", "fp8", "--out", root / f"{fam}-w4afp8")
        out[(fam, "w4a16")], out[(fam, "w4afp8")] = a, root / f"{fam}-w4afp8"
    return out


@pytest.fixture(scope="module")
def native(folders, tmp_path_factory) -> dict:
    keys = list(folders)
    jobs = [{"folder": str(folders[k]), "tp": 1, "create_weights": True,
             "quantization": "compressed-tensors"} for k in keys]
    return dict(zip(keys, run_probe(jobs, tmp_path_factory.mktemp("probe"))))


@pytest.fixture(scope="module")
def with_plugin(folders, tmp_path_factory) -> dict:
    keys = list(folders)
    jobs = [{"folder": str(folders[k]), "tp": 1} for k in keys]
    return dict(zip(keys, run_probe(jobs, tmp_path_factory.mktemp("pprobe"), plugins=True)))


def _experts(res):
    return {p: v for p, v in _modules(res) if p.endswith("mlp.experts")}


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_pick_w4afp8_moe_and_linears_w8a8_fp8(native, family):
    res = native[(family, "w4afp8")]
    assert [m["model_class"] for m in _models(res)] == [c for c in MODEL_CLASS[family] if c]
    experts = _experts(res)
    assert experts and all(v["scheme"] == "CompressedTensorsW4AFP8MoE" for v in experts.values()), experts
    for v in experts.values():
        assert v["weight_quant"] == {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                     "symmetric": True, "dynamic": False}
        assert v["input_quant"] == {"num_bits": 8, "type": "float", "strategy": "token", "group_size": None,
                                    "symmetric": True, "dynamic": True}
    strategy, block = FP8_BLOCK[family]
    fp8 = {p: v for p, v in _modules(res) if v.get("scheme") == "CompressedTensorsW8A8Fp8"}
    assert any(p.endswith("o_proj") for p in fp8) and any("shared_experts" in p for p in fp8)
    assert all((v["strategy"], v["block_structure"]) == (strategy, block) for v in fp8.values())
    # Everything but the experts' scheme is what the W4A16 twin gets.
    twin = native[(family, "w4a16")]
    for p, v in _modules(twin):
        if not p.endswith("mlp.experts"):
            assert dict(_modules(res))[p] == v, p
    assert all(v["scheme"] == "CompressedTensorsWNA16MoE" for v in _experts(twin).values())


@pytest.mark.parametrize("family", FAMILIES)
def test_sglang_w4afp8_moe_builds_experts_from_the_linear_group(native, family):
    """SGLang 0.5.23's CompressedTensorsW4AFP8MoE.__init__ reads target_scheme_map["Linear"]:
    kq's FP8 group. It then holds 8 bits / no group size and create_weights fails."""
    for p, v in _experts(native[(family, "w4afp8")]).items():
        assert v["scheme_attrs"] == {"num_bits": 8, "group_size": None, "packed_factor": 4}, (p, v)
        assert v["create_weights"] == {"error": "TypeError: unsupported operand type(s) for //: 'int' and 'NoneType'"}
    # The W4A16 twin's scheme builds its expert weights from the experts' own group.
    for p, v in _experts(native[(family, "w4a16")]).items():
        assert "error" not in v["create_weights"], (p, v)
        e = SMALL["n_experts"]
        assert v["create_weights"]["w13_weight_scale"][0][0] == e


@pytest.mark.parametrize("family", FAMILIES)
def test_plugin_serves_w4afp8_experts_saying_what_they_compute(with_plugin, family):
    computes = {"fp8": "w4a8 from 1024 tokens, w4a16 below", "none": "w4a16"}
    for variant, asked in (("w4afp8", "fp8"), ("w4a16", "none")):
        for p, v in _experts(with_plugin[(family, variant)]).items():
            assert v["method"] == "KqMoEMethod", (variant, p, v)
            assert (v["kq_activations"], v["kq_compute"]) == (asked, computes[asked]), (variant, p, v)
        fp8 = [v for p, v in _modules(with_plugin[(family, variant)]) if v.get("scheme") == "CompressedTensorsW8A8Fp8"]
        assert fp8


def test_w4afp8_twin_differs_from_its_source_only_in_config(folders):
    for fam in FAMILIES:
        a, b = folders[(fam, "w4a16")], folders[(fam, "w4afp8")]
        ca, cb = (json.loads((d / "config.json").read_text()) for d in (a, b))
        assert ca["quantization_config"]["config_groups"]["int4_experts"].get("input_activations") is None
        cb["quantization_config"]["config_groups"]["int4_experts"].pop("input_activations")
        assert ca == cb

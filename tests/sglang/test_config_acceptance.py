"""SGLang 0.5.23 reads kq's output config the way kq means it (issue 2's SGLang acceptance).

Every answer comes from SGLang's own code in the side venv (probe_config.py): its
CompressedTensorsConfig built by its model loader from the output config.json, its scheme
selection for each module name its model classes use (the MTP draft model's included), and its
shared-expert fusion decision; the GPU is simulated as an H100/H200 (capability 9.0).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from sglang_side import GROUP, REAL_EXPERTS, REPO

pytestmark = pytest.mark.sglang

FAMILIES = list(REAL_EXPERTS)
FP8_BLOCK = {"glm5": ("block", [128, 128]), "kimi_k2": ("block", [128, 128]), "glm4_moe": ("channel", None)}
MODEL_CLASS = {"glm5": ("GlmMoeDsaForCausalLM", "GlmMoeDsaForCausalLMNextN"),
               "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeForCausalLMNextN"),
               "kimi_k2": ("DeepseekV3ForCausalLM", None)}
BF16_SUFFIXES = ("mlp.gate", "indexer.weights_proj", "eh_proj")


def _models(res):
    return [res["main"]] + ([res["draft"]] if "draft" in res else [])


def _modules(res):
    for m in _models(res):
        yield from m["modules"].items()


@pytest.mark.parametrize("family", FAMILIES)
def test_sglang_builds_the_right_model_and_config(probe, family):
    res = probe[(family, "small")]
    assert res["sglang"] == "0.5.23" and res["compressed_tensors"] == "0.18.0"
    main_cls, draft_cls = MODEL_CLASS[family]
    assert res["main"]["model_class"] == main_cls
    assert (res.get("draft") or {}).get("model_class") == draft_cls
    for m in _models(res):
        assert m["quantization"] == "compressed-tensors"
        assert m["quant_config_class"] == "CompressedTensorsConfig"
        # SGLang takes weight_block_size from the group targeting Linear; MLA's kv_b_proj and the
        # DSA indexer's wk post-processing read it.
        assert m["weight_block_size"] == FP8_BLOCK[family][1]


@pytest.mark.parametrize("family", FAMILIES)
def test_routed_experts_pick_wna16_marlin_moe(probe, family):
    res = probe[(family, "small")]
    experts = {p: v for p, v in _modules(res) if p.endswith("mlp.experts")}
    # Two MoE layers in the small model, plus the MTP draft's decoder where the family has one.
    expected = {"model.layers.1.mlp.experts", "model.layers.2.mlp.experts"}
    if "draft" in res:
        expected.add("model.decoder.mlp.experts")
    assert set(experts) == expected
    for p, v in experts.items():
        assert v["method"] == "CompressedTensorsFusedMoEMethod", (p, v)
        assert v["scheme"] == "CompressedTensorsWNA16MoE", (p, v)  # SGLang's Marlin MoE on Hopper
        assert (v["num_bits"], v["group_size"], v["strategy"]) == (4, GROUP, "group"), (p, v)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_linears_pick_w8a8_fp8_with_source_block(probe, family):
    res = probe[(family, "small")]
    strategy, block = FP8_BLOCK[family]
    fp8 = {p: v for p, v in _modules(res) if v.get("scheme") == "CompressedTensorsW8A8Fp8"}
    names = {p.split(".")[-1] if "shared_experts" not in p else "shared_experts." + p.split(".")[-1] for p in fp8}
    must = {"o_proj", "gate_up_proj", "down_proj", "shared_experts.gate_up_proj", "shared_experts.down_proj"}
    must |= {"qkv_proj"} if family == "glm4_moe" else {"fused_qkv_a_proj_with_mqa", "q_b_proj", "kv_b_proj"}
    if family == "glm5":
        must |= {"wq_b", "wk"}  # DSA indexer
    assert must <= names, must - names
    for p, v in fp8.items():
        assert v["method"] == "CompressedTensorsLinearMethod"
        assert (v["strategy"], v["block_structure"]) == (strategy, block), (p, v)
    # Nothing quantizable falls outside INT4 experts, FP8 linears and the BF16 set.
    for p, v in _modules(res):
        if p.endswith("mlp.experts") or p in fp8:
            continue
        assert p.endswith(BF16_SUFFIXES) or p in ("lm_head", "model.shared_head.head"), (p, v)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_modules_stay_unquantized(probe, family):
    res = probe[(family, "small")]
    seen = set()
    for p, v in _modules(res):
        if p in ("lm_head", "model.shared_head.head"):
            # ParallelLMHead: no scheme means SGLang's unquantized embedding method.
            assert v["method"] is None and v["scheme"] is None, (p, v)
            seen.add("lm_head")
        elif p.endswith(BF16_SUFFIXES):
            # SGLang builds these without a quant_config; the config agrees (ignore list), so a
            # code path that did pass it would still load them unquantized.
            assert v["method"] == "built without quant_config", (p, v)
            assert v["config_says"]["method"] == "UnquantizedLinearMethod", (p, v)
            seen.add(next(s for s in BF16_SUFFIXES if p.endswith(s)))
    expected = {"lm_head", "mlp.gate"} | ({"eh_proj"} if "draft" in res else set())
    expected |= {"indexer.weights_proj"} if family == "glm5" else set()
    assert seen == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_compressed_tensors_018_round_trips_the_config(probe, family):
    assert probe[(family, "small")]["ct_roundtrip"] is True


@pytest.mark.parametrize("family", FAMILIES)
def test_compressed_tensors_main_venv_round_trips_the_config(kq_outputs, family):
    # compressed-tensors 0.19 (main venv), in a subprocess: it imports Triton, and the
    # Triton-interpreter kernel tests must be the first to import it in the pytest process.
    code = ("import json, sys; from compressed_tensors.quantization import QuantizationConfig as Q; "
            "qc = json.load(open(sys.argv[1]))['quantization_config']; p = Q.model_validate(qc); "
            "again = Q.model_validate(json.loads(json.dumps(p.model_dump()))); "
            "print(json.dumps({'equal': again == p, 'format': p.format}))")
    r = subprocess.run([sys.executable, "-c", code, str(kq_outputs[family] / "config.json")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"equal": True, "format": "pack-quantized"}


# SGLang 0.5.23's decision at the real models' expert counts, on Hopper, default flags.
# GLM-5.x (256 experts, DeepseekV2 rule) and GLM-4.x (Glm4Moe rule) would fuse the FP8 shared
# expert into the INT4 routed MoE: wrong weights loaded into INT4 slots. Kimi K2 (384 experts)
# is not fused (SGLang allows 384 only for Quark checkpoints).
FUSES_BY_DEFAULT = {"glm5": True, "glm4_moe": True, "kimi_k2": False}


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_expert_fusion_decision(probe, family):
    for m in _models(probe[(family, "real")]):
        se = m["shared_experts"]
        assert se["fusion_disabled"] is (not FUSES_BY_DEFAULT[family]), (m["model_class"], se)
        assert se["num_fused_shared_experts"] == (1 if FUSES_BY_DEFAULT[family] else 0)
    # --disable-shared-experts-fusion keeps them apart for every family, draft included.
    for m in _models(probe[(family, "real+flag")]):
        assert m["shared_experts"]["fusion_disabled"] is True
        assert m["shared_experts"]["num_fused_shared_experts"] == 0


def test_docs_launch_lines_disable_fusion():
    """Every native (compressed-tensors) SGLang launch line kq documents carries
    --disable-shared-experts-fusion, because SGLang would otherwise fuse (test above)."""
    lines = []
    for doc in (REPO / "README.md", REPO / "docs" / "sglang.md"):
        if doc.is_file():
            lines += [ln for ln in doc.read_text().splitlines() if re.search(r"sglang\.launch_server", ln)]
    native = [ln for ln in lines if "--quantization kq" not in ln]
    assert native, "no native SGLang launch line documented"
    for ln in native:
        assert "--disable-shared-experts-fusion" in ln, ln

"""SGLang 0.5.23 on the configs kq writes for the real GLM-5.2-FP8 and Kimi-K2-Instruct, against the
real tensor names (../shared/layouts): the full model's config as the plan writes it, and the
config of each converted real-layout slice.

Every Linear of the real checkpoint is mapped to the module SGLang builds for it (its fused names:
q_a_proj + kv_a_proj_with_mqa -> fused_qkv_a_proj_with_mqa, gate/up -> gate_up_proj, the experts of a
layer -> one FusedMoE; the MTP layer 78 -> the draft's model.decoder, its eh_proj -> model.eh_proj),
and SGLang's scheme for that module must match the tensors' storage: INT4 for routed experts,
block-FP8 for FP8 weights, unquantized for BF16. Both directions: no checkpoint Linear without a
module, no module without its tensors (bar the draft's head, which shares lm_head).
"""
from __future__ import annotations

import json
import re

import pytest

from real_layouts import GLM, KIMI, MODELS, is_expert, layout
from sglang_side import run_probe

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def sglang_modules(model: str) -> dict[tuple[bool, str], set[str]]:
    """{(draft?, SGLang module prefix): storage kinds of its checkpoint tensors ("int4" | dtype)}."""
    n_layers = MODELS[model]["layers"]
    out: dict[tuple[bool, str], set[str]] = {}
    for name, (dt, shape, _) in layout(model).tensors.items():
        if not name.endswith(".weight") or len(shape) != 2 or name == "model.embed_tokens.weight":
            continue  # norms, biases, scales, inv_freq, embeddings: not Linear modules
        kind = "int4" if is_expert(name) else dt
        mod = name[: -len(".weight")]
        if mod == "lm_head":
            out.setdefault((False, "lm_head"), set()).add(kind)
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", mod)
        assert m, name
        layer, rest = int(m.group(1)), m.group(2)
        rest = re.sub(r"^self_attn\.(q_a_proj|kv_a_proj_with_mqa)$", "self_attn.fused_qkv_a_proj_with_mqa", rest)
        rest = re.sub(r"^(mlp|mlp\.shared_experts)\.(gate|up)_proj$", r"\1.gate_up_proj", rest)
        rest = re.sub(r"^mlp\.experts\.\d+\.(gate|up|down)_proj$", "mlp.experts", rest)
        draft = layer >= n_layers
        prefix = ("model." + rest if rest == "eh_proj" else "model.decoder." + rest) if draft \
            else f"model.layers.{layer}.{rest}"
        out.setdefault((draft, prefix), set()).add(kind)
    return out


@pytest.fixture(scope="module")
def answers(tmp_path_factory, real_slices):
    from kq.synth.real_layouts import LayoutSource, bundled_layout
    from kq.quantize.plan import make_plan
    from kq.quantize.run import output_config

    tmp = tmp_path_factory.mktemp("real-probe")
    keys, jobs = [], []
    for model in MODELS:
        source = LayoutSource.open(bundled_layout(layout(model).repo_id))
        full = tmp / f"{model}-full"
        full.mkdir()
        cfg = output_config(source, make_plan(source, group_size=MODELS[model]["group"], tp=8))
        (full / "config.json").write_text(json.dumps(cfg))
        for variant, folder in (("full", full), ("slice", real_slices(model)[1])):
            keys.append((model, variant))
            jobs.append({"folder": str(folder), "tp": 8, "disable_shared_experts_fusion": True})
    return dict(zip(keys, run_probe(jobs, tmp)))


@pytest.mark.parametrize("variant", ["full", "slice"])
@pytest.mark.parametrize("model", list(MODELS))
def test_every_real_linear_gets_the_scheme_of_its_storage(answers, model, variant):
    res = answers[model, variant]
    assert res["sglang"] == "0.5.23" and res["ct_roundtrip"] is True
    assert res["main"]["model_class"] == {GLM: "GlmMoeDsaForCausalLM", KIMI: "DeepseekV3ForCausalLM"}[model]
    assert ("draft" in res) is (model == GLM)  # GLM-5.2's MTP layer 78; Kimi K2 has none
    if "draft" in res:
        assert res["draft"]["model_class"] == "GlmMoeDsaForCausalLMNextN"
    want = sglang_modules(model)
    got = {(False, p): v for p, v in res["main"]["modules"].items()}
    got |= {(True, p): v for p, v in (res.get("draft") or {}).get("modules", {}).items()}
    assert set(got) - {(True, "model.shared_head.head")} == set(want)  # exact names, both directions
    group = MODELS[model]["group"]
    for key, kinds in want.items():
        assert len(kinds) == 1, (key, kinds)  # a fused module never mixes storages
        kind, v = next(iter(kinds)), got[key]
        if kind == "int4":
            assert (v["scheme"], v["num_bits"], v["group_size"]) == ("CompressedTensorsWNA16MoE", 4, group), (key, v)
        elif kind == "F8_E4M3":
            assert (v["scheme"], v["strategy"], v["block_structure"]) == (
                "CompressedTensorsW8A8Fp8", "block", [128, 128]), (key, v)
        elif key[1] == "lm_head":
            assert v["method"] is None and v["scheme"] is None, (key, v)
        else:  # BF16 router, indexer weights_proj, MTP eh_proj: built without a quant config, and ignored by it
            assert kind == "BF16" and v["method"] == "built without quant_config", (key, v)
            assert v["config_says"]["method"] == "UnquantizedLinearMethod", (key, v)
    if model == GLM:
        # The DSA indexer exists on the 21 "full" layers and the MTP layer, exactly where the tensors are.
        idx = sorted(p for d, p in want if p.endswith("indexer.wk"))
        types = layout(GLM).config["indexer_types"]
        assert len(types) == 78 and len(idx) == 22
        assert idx == sorted([f"model.layers.{i}.self_attn.indexer.wk" for i, t in enumerate(types) if t == "full"]
                             + ["model.decoder.self_attn.indexer.wk"])

"""kq.synth: synthetic checkpoints must look like the real ones (names, dtypes, shapes,
config, index) and be deterministic. The trained tiny GLM-5.2 model is the reference
for the glm5 layout."""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kq.synth import FAMILIES, generate

TINY = Path(__file__).resolve().parents[3] / "shared" / "models" / "tiny-glm-5.2-fp8"
if not TINY.exists():
    TINY = Path("/work/shared/models/tiny-glm-5.2-fp8")
TINY_INDEXERS = ["full", "full", "shared", "full"]


# -- helpers (independent of kq.synth internals) --------------------------------------
def index_of(folder: Path) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def tensors(folder: Path) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """{name: (file, dtype, shape)} read from the shard headers themselves."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                s = h.get_slice(k)
                out[k] = (f.name, s.get_dtype(), tuple(s.get_shape()))
    return out


def load(folder: Path, name: str) -> torch.Tensor:
    f = index_of(folder)["weight_map"][name] if (folder / "model.safetensors.index.json").exists() else "model.safetensors"
    with safe_open(folder / f, "pt") as h:
        return h.get_tensor(name)


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def pattern(name: str) -> str:
    name = re.sub(r"\.experts\.\d+\.", ".experts.E.", name)
    return re.sub(r"^model\.layers\.\d+\.", "model.layers.L.", name)


def check_index(folder: Path) -> None:
    """The index names exactly the tensors in the shards, each in its own file, and
    total_size is the sum of the tensor data bytes."""
    idx, ts = index_of(folder), tensors(folder)
    assert idx["weight_map"] == {k: v[0] for k, v in ts.items()}
    sizes = {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}
    assert idx["metadata"]["total_size"] == sum(math.prod(s) * sizes[d] for _, d, s in ts.values())
    for f in set(idx["weight_map"].values()):
        raw = (folder / f).read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        assert json.loads(raw[8 : 8 + n])["__metadata__"] == {"format": "pt"}


def block_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    out, inn = q.shape
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :inn]
    return q.float() * full


# -- glm5 -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def glm5(tmp_path_factory) -> Path:
    return generate("glm5", tmp_path_factory.mktemp("g") / "glm5", indexer_types=TINY_INDEXERS)


@pytest.mark.skipif(not TINY.exists(), reason="trained tiny model not present")
def test_glm5_tiny_matches_trained_model_exactly(glm5):
    """Same dims as the trained model -> same names, dtypes, shapes, config, total_size."""
    mine = {k: v[1:] for k, v in tensors(glm5).items()}
    ref = {k: v[1:] for k, v in tensors(TINY).items()}
    assert mine == ref
    assert index_of(glm5)["metadata"] == index_of(TINY)["metadata"]
    assert json.loads((glm5 / "config.json").read_text()) == json.loads((TINY / "config.json").read_text())
    assert sorted(p.name for p in glm5.iterdir()) == sorted(p.name for p in TINY.iterdir())


@pytest.mark.skipif(not TINY.exists(), reason="trained tiny model not present")
def test_glm5_name_patterns_match_trained_model_at_other_sizes(tmp_path):
    p = generate("glm5", tmp_path / "c", num_layers=7, n_experts=5, first_k_dense=2, n_shards=4)
    assert {pattern(n) for n in tensors(p)} == {pattern(n) for n in tensors(TINY)}
    cfg = json.loads((p / "config.json").read_text())
    # GLM-5.2 rule: full if i<3 or i%4==2 -> layers 3, 4, 5 shared; the MTP layer 7 has its own
    assert cfg["indexer_types"] == ["full", "full", "full", "shared", "shared", "shared", "full"]
    names = set(tensors(p))
    for i in range(8):
        assert (f"model.layers.{i}.self_attn.indexer.wk.weight" in names) == (i not in (3, 4, 5))
    assert cfg["mlp_layer_types"] == ["dense"] * 2 + ["sparse"] * 5
    assert "model.layers.1.mlp.down_proj.weight" in names and "model.layers.2.mlp.experts.4.up_proj.weight" in names
    assert "model.layers.7.eh_proj.weight" in names and "model.layers.8.input_layernorm.weight" not in names
    nc = cfg["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.7.eh_proj" in nc and "model.layers.6.mlp.gate.e_score_correction_bias" in nc
    check_index(p)


def test_glm5_index_covers_exactly_the_shards(glm5):
    check_index(glm5)
    assert len(set(index_of(glm5)["weight_map"].values())) == 3


def test_glm5_fp8_values_are_block_quantized_like_deepseek(glm5):
    """weight_scale_inv is amax/448 per 128x128 block (a multiplier): every block's
    largest |code| is 448, and dequantized weights look like N(0, 0.02)."""
    q = load(glm5, "model.layers.0.mlp.down_proj.weight")  # [256, 768]
    s = load(glm5, "model.layers.0.mlp.down_proj.weight_scale_inv")
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (2, 6)
    amax = q.float().abs().view(2, 128, 6, 128).amax(dim=(1, 3))
    assert torch.equal(amax, torch.full((2, 6), 448.0))
    w = block_dequant(q, s)
    assert 0.015 < w.std().item() < 0.03 and abs(w.mean().item()) < 1e-3
    assert len(set(s.flatten().tolist())) == 12  # blocks differ
    assert load(glm5, "model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
    assert load(glm5, "model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32


def test_glm5_deterministic(tmp_path):
    a = generate("glm5", tmp_path / "a", seed=3)
    b = generate("glm5", tmp_path / "b", seed=3)
    c = generate("glm5", tmp_path / "c", seed=4)
    assert digest(a) == digest(b)
    da, dc = digest(a), digest(c)
    assert da["config.json"] == dc["config.json"]
    assert all(da[f] != dc[f] for f in da if f.endswith(".safetensors"))


def test_parallel_workers_give_the_same_bytes(tmp_path):
    a = generate("glm5", tmp_path / "a", split_scale=True)
    b = generate("glm5", tmp_path / "b", split_scale=True, workers=3)
    assert digest(a) == digest(b)


def test_odd_case_split_scale(tmp_path):
    p = generate("glm5", tmp_path / "s", split_scale=True)
    wm = index_of(p)["weight_map"]
    moved = [n for n in wm if n.endswith("_scale_inv") and wm[n] != wm[n.removesuffix("_scale_inv")]]
    assert len(moved) > 10
    check_index(p)
    # values do not depend on where the scale sits
    ref = generate("glm5", tmp_path / "r")
    for n in moved[:5]:
        assert torch.equal(load(p, n), load(ref, n))
        w = n.removesuffix("_scale_inv")
        assert torch.equal(load(p, w).view(torch.uint8), load(ref, w).view(torch.uint8))


def test_odd_case_dims_not_divisible_by_128(tmp_path):
    p = generate("glm5", tmp_path / "o", hidden=200, moe_intermediate=72, n_experts=2, num_layers=2)
    q = load(p, "model.layers.1.mlp.experts.1.down_proj.weight")
    s = load(p, "model.layers.1.mlp.experts.1.down_proj.weight_scale_inv")
    assert q.shape == (200, 72) and s.shape == (2, 1)
    w = block_dequant(q, s)
    # the partial last block's scale comes from its own 72 rows
    assert torch.allclose(s[1, 0], w[128:].abs().max() / 448, rtol=1e-6)
    assert load(p, "model.layers.0.self_attn.o_proj.weight_scale_inv").shape == (2, 2)  # [200, 256]
    check_index(p)


def test_odd_case_language_model_prefix_keeps_bytes(tmp_path):
    p = generate("glm5", tmp_path / "p", prefix="language_model.")
    plain = generate("glm5", tmp_path / "q")
    names = set(tensors(p))
    assert all(n.startswith("language_model.model.") or n == "language_model.lm_head.weight" for n in names)
    assert {n.removeprefix("language_model.") for n in names} == set(tensors(plain))
    nc = json.loads((p / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert all(m.startswith("language_model.") for m in nc)
    n = "model.layers.3.mlp.experts.7.gate_proj.weight"
    assert torch.equal(load(p, "language_model." + n).view(torch.uint8), load(plain, n).view(torch.uint8))


def test_odd_cases_no_mtp_unpadded_single_file(tmp_path):
    p = generate("glm5", tmp_path / "n", mtp=False, shard_names="unpadded", n_shards=2)
    names = set(tensors(p))
    assert not any(n.startswith("model.layers.4.") for n in names)
    assert json.loads((p / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert sorted(f.name for f in p.glob("*.safetensors")) == ["model-1-of-2.safetensors", "model-2-of-2.safetensors"]
    check_index(p)
    s = generate("glm5", tmp_path / "one", single_file=True)
    assert not (s / "model.safetensors.index.json").exists()
    assert set(tensors(s)) == set(tensors(generate("glm5", tmp_path / "ref")))


def test_refuses_non_empty_out_dir_and_unknown_options(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        generate("glm5", tmp_path / "x")
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"
    with pytest.raises(TypeError, match="hiden"):
        generate("glm5", tmp_path / "y", hiden=3)
    with pytest.raises(ValueError, match="unknown family"):
        generate("glm9", tmp_path / "z")
    assert not (tmp_path / "y").exists() and not (tmp_path / "z").exists()


def test_families_registry_lists_options_with_help():
    assert "glm5" in FAMILIES
    for fam in FAMILIES.values():
        assert fam.description
        assert all(opt.help for opt in fam.options.values())


# -- every family -------------------------------------------------------------------------
ALL = ["glm5", "glm4_moe", "kimi_k2", "kimi_k25"]


@pytest.mark.parametrize("family", ALL)
def test_family_generates_complete_deterministic_folder(family, tmp_path):
    a = generate(family, tmp_path / "a", seed=11)
    b = generate(family, tmp_path / "b", seed=11)
    check_index(a)
    assert digest(a) == digest(b)
    for f in ("config.json", "generation_config.json", "tokenizer_config.json"):
        json.loads((a / f).read_text())
    assert (a / "tokenizer.json").exists() or (a / "tiktoken.model").exists()
    assert not [p for p in a.parent.iterdir() if "synth-tmp" in p.name]  # no temp left behind


@pytest.mark.parametrize("family", ALL)
def test_streamed_shards_equal_safetensors_own_writer(family, tmp_path):
    """The streaming writer lays out bytes exactly as safetensors.torch.save_file does."""
    from safetensors.torch import load_file, save_file

    p = generate(family, tmp_path / "s", split_scale=True)
    for f in sorted(p.glob("*.safetensors")):
        save_file(load_file(f), tmp_path / "re.safetensors", metadata={"format": "pt"})
        assert (tmp_path / "re.safetensors").read_bytes() == f.read_bytes(), f.name


def test_registry_has_all_families():
    assert set(FAMILIES) == set(ALL)


@pytest.mark.parametrize("family", ALL)
def test_listed_defaults_are_what_gets_written(family, tmp_path):
    from kq.synth.families import build

    opts = FAMILIES[family].options
    cfg = json.loads((generate(family, tmp_path / "d") / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    assert cfg["hidden_size"] == opts["hidden"].default
    assert cfg["n_routed_experts"] == opts["n_experts"].default
    assert cfg["num_hidden_layers"] == opts["num_layers"].default
    # size="full" swaps the preset in, an explicit option still wins
    names = [e.name for e in build(family, 0, {"size": "full", "n_experts": 2}).layout.entries]
    assert not any(".experts.2." in n for n in names) and any(".experts.1." in n for n in names)


# -- glm4_moe -------------------------------------------------------------------------------
def test_glm4_moe_per_channel_fp8_layout(tmp_path):
    p = generate("glm4_moe", tmp_path / "g")
    ts = {k: v[1:] for k, v in tensors(p).items()}
    a = "model.layers.1.self_attn"
    assert ts[f"{a}.q_proj.weight"] == ("F8_E4M3", (256, 256)) and ts[f"{a}.q_proj.bias"] == ("BF16", (256,))
    assert ts[f"{a}.k_proj.weight"] == ("F8_E4M3", (128, 256)) and ts[f"{a}.k_proj.weight_scale"] == ("BF16", (128, 1))
    assert ts[f"{a}.v_proj.bias"] == ("BF16", (128,)) and f"{a}.o_proj.bias" not in ts
    assert ts[f"{a}.q_norm.weight"] == ("BF16", (64,)) and ts[f"{a}.k_norm.weight"] == ("BF16", (64,))
    assert ts["model.layers.2.mlp.experts.15.down_proj.weight"] == ("F8_E4M3", (256, 512))
    assert ts["model.layers.2.mlp.experts.15.down_proj.weight_scale"] == ("BF16", (256, 1))
    assert ts["model.layers.0.mlp.gate_proj.weight"] == ("F8_E4M3", (768, 256))
    assert ts["model.layers.3.mlp.gate.weight"] == ("BF16", (16, 256))
    assert ts["model.layers.3.mlp.gate.e_score_correction_bias"] == ("F32", (16,))
    assert ts["model.layers.4.eh_proj.weight"] == ("BF16", (256, 512))  # MTP layer
    assert not any("weight_scale_inv" in n for n in ts)
    # per-channel scale: every row's largest |code| sits at the top of the FP8 range
    q = load(p, "model.layers.1.mlp.experts.3.up_proj.weight").float()
    s = load(p, "model.layers.1.mlp.experts.3.up_proj.weight_scale")
    top = q.abs().amax(dim=1)
    assert top.min() >= 440 and top.max() <= 448
    w = q * s.float()
    assert 0.015 < w.std().item() < 0.03
    assert len(set(s.flatten().tolist())) > 100  # rows differ


def test_glm4_moe_config_is_valid_compressed_tensors(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    p = generate("glm4_moe", tmp_path / "g")
    cfg = json.loads((p / "config.json").read_text())
    qc = cfg["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.format == "float-quantized" and parsed.quant_method == "compressed-tensors"
    (group,) = parsed.config_groups.values()
    assert group.targets == ["Linear"]
    assert (group.weights.num_bits, group.weights.type, group.weights.strategy) == (8, "float", "channel")
    assert group.input_activations.dynamic is True and group.input_activations.strategy == "token"
    assert set(qc["ignore"]) == {"lm_head", "model.layers.4.eh_proj"} | {f"model.layers.{i}.mlp.gate" for i in (1, 2, 3, 4)}
    assert cfg["model_type"] == "glm4_moe" and cfg["architectures"] == ["Glm4MoeForCausalLM"]
    assert cfg["attention_bias"] is True and cfg["use_qk_norm"] is True and cfg["num_nextn_predict_layers"] == 1


def test_glm4_moe_expert_sizes_for_tp_checks(tmp_path):
    p = generate("glm4_moe", tmp_path / "ok")
    i = json.loads((p / "config.json").read_text())["moe_intermediate_size"]
    assert (i // 8) % 64 == 0 and (i // 8) % 32 == 0  # valid at TP 8 for Marlin, group 32
    r = generate("glm4_moe", tmp_path / "real", real_ratio=True)
    i = json.loads((r / "config.json").read_text())["moe_intermediate_size"]
    assert i == 384 and (i // 8) % 64 != 0  # 48 per rank: Marlin refuses it
    assert tensors(r)["model.layers.1.mlp.experts.0.gate_proj.weight"][2] == (384, 256)


def test_glm4_moe_scale_dtype_option(tmp_path):
    p = generate("glm4_moe", tmp_path / "f32", scale_dtype="F32", num_layers=2, n_experts=2)
    assert tensors(p)["model.layers.1.mlp.experts.1.down_proj.weight_scale"][1:] == ("F32", (256, 1))
    with pytest.raises(ValueError):
        generate("glm4_moe", tmp_path / "bad", scale_dtype="I8")


# -- kimi_k2 --------------------------------------------------------------------------------
def test_kimi_k2_layout(tmp_path):
    p = generate("kimi_k2", tmp_path / "k")
    assert sorted(f.name for f in p.glob("*.safetensors")) == [f"model-{i}-of-3.safetensors" for i in (1, 2, 3)]
    cfg = json.loads((p / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k2" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["auto_map"]["AutoConfig"] == "configuration_deepseek.DeepseekV3Config"
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_deepseek.DeepseekV3ForCausalLM"
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "weight_block_size": [128, 128]}
    ts = {k: v[1:] for k, v in tensors(p).items()}
    assert not any(".indexer." in n for n in ts)
    assert ts["model.layers.0.mlp.down_proj.weight_scale_inv"] == ("F32", (2, 6))  # layer 0 dense
    assert ts["model.layers.2.mlp.experts.15.gate_proj.weight"] == ("F8_E4M3", (256, 256))
    assert ts["model.layers.1.self_attn.kv_b_proj.weight"] == ("F8_E4M3", (512, 128))
    assert not any(n.startswith("model.layers.3.") for n in ts)  # no MTP by default
    assert {pattern(n) for n in ts} <= {pattern(n) for n in tensors(TINY)} if TINY.exists() else True


def test_kimi_k2_remote_code_placeholders_refuse_to_run(tmp_path):
    p = generate("kimi_k2", tmp_path / "k")
    for f in ("configuration_deepseek.py", "modeling_deepseek.py", "tokenization_kimi.py"):
        code = (p / f).read_text()
        with pytest.raises(RuntimeError, match="must never be executed"):
            exec(compile(code, f, "exec"), {})


def test_kimi_k2_tiktoken_file_is_valid_bpe(tmp_path):
    import base64

    p = generate("kimi_k2", tmp_path / "k")
    ranks = {}
    for line in (p / "tiktoken.model").read_text().splitlines():
        tok, rank = line.split()
        ranks[base64.b64decode(tok)] = int(rank)
    assert sorted(ranks.values()) == list(range(len(ranks)))
    assert all(ranks[bytes([b])] == b for b in range(256))
    for tok, r in ranks.items():  # every merged token splits into two lower-ranked tokens
        if len(tok) > 1:
            assert any(ranks.get(tok[:k], r) < r and ranks.get(tok[k:], r) < r for k in range(1, len(tok)))
    tc = json.loads((p / "tokenizer_config.json").read_text())
    vocab = json.loads((p / "config.json").read_text())["vocab_size"]
    ids = {v["content"]: int(k) for k, v in tc["added_tokens_decoder"].items()}
    assert all(len(ranks) <= i < vocab for i in ids.values())
    assert tc["auto_map"]["AutoTokenizer"][0] == "tokenization_kimi.TikTokenTokenizer"
    cfg = json.loads((p / "config.json").read_text())
    assert cfg["bos_token_id"] == ids["[BOS]"] and cfg["eos_token_id"] == ids["[EOS]"]


# -- kimi_k25 (already INT4) ------------------------------------------------------------------
def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    words = packed.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(words >> (4 * k)) & 0xF for k in range(8)], dim=2).flatten(1)


def test_kimi_k25_is_already_int4(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    p = generate("kimi_k25", tmp_path / "k")
    cfg = json.loads((p / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    assert "quantization_config" not in cfg  # public K2.5 configs keep it in text_config
    qc = QuantizationConfig.model_validate(cfg["text_config"]["quantization_config"])
    assert qc.format == "pack-quantized"
    (g,) = qc.config_groups.values()
    assert (g.weights.num_bits, g.weights.group_size, g.weights.symmetric) == (4, 32, True)
    ts = {k: v[1:] for k, v in tensors(p).items()}
    text = [n for n in ts if not n.startswith(("vision_tower.", "mm_projector."))]
    assert text and all(n.startswith("language_model.") for n in text)
    x = "language_model.model.layers.1.mlp.experts.3.down_proj"
    assert ts[f"{x}.weight_packed"] == ("I32", (256, 32))
    assert ts[f"{x}.weight_scale"] == ("BF16", (256, 8))
    assert ts[f"{x}.weight_shape"] == ("I32", (2,))
    assert load(p, f"{x}.weight_shape").tolist() == [256, 256]
    assert ts["language_model.model.layers.1.self_attn.o_proj.weight"][0] == "BF16"
    assert not any(d == "F8_E4M3" for d, _ in ts.values())
    nib = unpack_nibbles(load(p, f"{x}.weight_packed"))
    assert nib.min() >= 1 and nib.max() <= 15  # codes in [-7, 7]
    q = (nib - 8).float().view(256, 8, 32)
    assert torch.equal(q.abs().amax(dim=2), torch.full((256, 8), 7.0))  # scale = amax/7 per group
    w = (q * load(p, f"{x}.weight_scale").float().unsqueeze(2)).flatten(1)
    assert 0.015 < w.std().item() < 0.03
    both = json.loads((generate("kimi_k25", tmp_path / "b", quant_config_in="both") / "config.json").read_text())
    assert both["quantization_config"] == both["text_config"]["quantization_config"]
    assert both["quantization_config"]["format"] == "pack-quantized"


# -- full-size shapes (planned, not written: writing 10 GB is for benchmarks) --------------------
def test_full_size_glm52_layer_plan():
    from kq.synth.families import build

    plan = build("glm5", 0, {"size": "full", "max_shard_bytes": 2 << 30})
    ts = {e.name: e for e in plan.layout.entries}
    e = ts["model.layers.0.mlp.experts.255.down_proj.weight"]
    assert (e.dtype, e.shape) == ("F8_E4M3", (6144, 2048))
    assert ts["model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"].shape == (16, 48)
    assert ts["model.layers.0.self_attn.q_b_proj.weight"].shape == (64 * 256, 2048)
    experts = sum(x.nbytes for n, x in ts.items() if ".experts." in n)
    assert 9.6e9 < experts < 9.8e9  # 256 x 3 x 2048 x 6144 FP8 + scales
    sizes: dict[str, int] = {}
    for n, f in plan.assignment.items():
        sizes[f] = sizes.get(f, 0) + ts[n].nbytes
    assert len(sizes) >= 5 and max(sizes.values()) < 2.2 * 2**30


@pytest.mark.slow
def test_streaming_writer_bounds_memory(tmp_path):
    """A single 4096 x 6144 FP8 weight (96 MB as float32, ~300 MB with the temporaries of
    quantizing it whole) is written with far less extra resident memory: the writer
    works 128 rows at a time."""
    import subprocess
    import sys

    code = f"""
import resource, torch
from kq.synth.layout import Layout
from kq.synth.assemble import write_folder
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
lay = Layout(0)
lay.fp8_block_linear("big", 4096, 6144)
write_folder({str(tmp_path / 'big')!r}, lay, {{e.name: "model.safetensors" for e in lay.entries}}, {{}}, index=False)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    grown_mb = int(out.stdout.split()[-1])
    assert grown_mb < 48, grown_mb
    with safe_open(tmp_path / "big" / "model.safetensors", "pt") as h:
        q, s = h.get_tensor("big.weight"), h.get_tensor("big.weight_scale_inv")
    assert q.shape == (4096, 6144) and s.shape == (32, 48)
    assert torch.equal(q.float().abs().view(32, 128, 48, 128).amax(dim=(1, 3)), torch.full((32, 48), 448.0))


# -- more odd cases and the command line --------------------------------------------------
def test_odd_case_per_channel_fp8_in_deepseek_layout(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    for family in ("glm5", "kimi_k2"):
        p = generate(family, tmp_path / family, fp8="channel", scale_dtype="F32")
        ts = {k: v[1:] for k, v in tensors(p).items()}
        assert ts["model.layers.1.mlp.experts.0.up_proj.weight_scale"] == ("F32", (256, 1))
        assert not any(n.endswith("weight_scale_inv") for n in ts)
        qc = json.loads((p / "config.json").read_text())["quantization_config"]
        assert QuantizationConfig.model_validate(qc).format == "float-quantized"
        assert "lm_head" in qc["ignore"] and "model.layers.1.mlp.gate" in qc["ignore"]
    with pytest.raises(ValueError, match="fp8"):
        generate("glm5", tmp_path / "bad", fp8="int8")


def test_glm52_indexers_proj_quirk(tmp_path):
    p = generate("glm5", tmp_path / "q", indexers_proj_quirk=True, n_experts=2)
    nc = json.loads((p / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.self_attn.indexers_proj" in nc and "model.layers.3.self_attn.indexers_proj" not in nc
    assert "model.layers.0.self_attn.indexer.weights_proj.weight" in tensors(p)


def test_command_line(tmp_path, capsys):
    from kq.synth.__main__ import main

    assert main(["--list"]) == 0
    listing = capsys.readouterr().out
    assert all(f in listing for f in ALL) and "split_scale" in listing
    assert main(["kimi_k2", str(tmp_path / "k"), "num_layers=2", "n_experts=3", "mtp=true", "seed=5"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "k")
    assert "model.layers.2.eh_proj.weight" in tensors(tmp_path / "k")
    assert digest(tmp_path / "k") == digest(generate("kimi_k2", tmp_path / "k2", seed=5, num_layers=2, n_experts=3, mtp=True))
    assert main(["kimi_k2", str(tmp_path / "x"), "colour=red"]) == 2
    assert "colour" in capsys.readouterr().err


@pytest.mark.parametrize("family", ALL)
def test_tokenizer_ids_stay_inside_a_small_vocab(family, tmp_path):
    import base64

    p = generate(family, tmp_path / "v", vocab=300, num_layers=2, n_experts=2)
    if (p / "tokenizer.json").exists():
        import tokenizers

        tok = tokenizers.Tokenizer.from_file(str(p / "tokenizer.json"))
        assert tok.get_vocab_size() <= 300
        ids = tok.encode("the word was quantized").ids
        assert tok.decode(ids) == "the word was quantized"
    else:
        ranks = [int(line.split()[1]) for line in (p / "tiktoken.model").read_text().splitlines()]
        specials = [int(k) for k in json.loads((p / "tokenizer_config.json").read_text())["added_tokens_decoder"]]
        assert max(ranks) < min(specials) and max(specials) < 300
    with pytest.raises(ValueError, match="vocab too small"):
        generate(family, tmp_path / "tiny", vocab=200)


@pytest.mark.parametrize("family", ["glm5", "glm4_moe"])
def test_transformers_reads_the_config(family, tmp_path):
    from transformers import AutoConfig

    p = generate(family, tmp_path / "c", num_layers=3, first_k_dense=1, n_experts=2)
    cfg = AutoConfig.from_pretrained(p)  # no remote code: these are transformers-native types
    assert cfg.model_type == family.replace("glm5", "glm_moe_dsa")
    assert (cfg.num_hidden_layers, cfg.n_routed_experts, cfg.first_k_dense_replace) == (3, 2, 1)

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

TINY = Path(__file__).resolve().parents[2] / "shared" / "models" / "tiny-glm-5.2-fp8"
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

"""FP8 KV-cache scales: calibration (kq quantize --kv-cache fp8), the emulated e4m3 cache of kq eval."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from kq.checkpoint.reader import CheckpointReader
from kq.errors import KqError
from kq.eval.kvcache import emulate_fp8_kv, qdq, qdq_blocks
from kq.model import LayerwiseModel
from kq.quantize.kv_scales import KV_CACHE_SCHEME, calibrate_kv_scales, check_mla, read_scales
from kq_testutil import SHARED, TINY_MODEL, run_kq

CALIB = SHARED / "data" / "calibration_text.txt.gz"
EVAL_TEXT = SHARED / "data" / "eval_text.txt.gz"


def test_e4m3_round_trip_against_hand_values():
    # e4m3: 3 mantissa bits. 1.0625 lies between 1.0 and 1.125 (ties to even: 1.0); 300 -> 288 or 320 (step 32).
    x = torch.tensor([1.0, 1.0625, 1.1875, 300.0, 1000.0, -0.0])
    assert qdq(x, 1.0).tolist() == [1.0, 1.0, 1.25, 288.0, 448.0, -0.0]
    assert qdq(x * 2, 2.0).tolist() == [2.0, 2.0, 2.5, 576.0, 896.0, -0.0]   # same codes, scaled
    # Per-128 blocks: each block's amax maps to 448 exactly, so it survives; a block of zeros stays zero.
    b = torch.zeros(1, 256)
    b[0, 3], b[0, 5] = 7.0, 0.01
    y = qdq_blocks(b)
    assert y[0, 3] == 7.0 and y[0, 128:].abs().sum() == 0
    assert abs(float(y[0, 5]) - 0.01) < 0.01 / 8


def test_calibrated_scale_is_the_latent_amax_over_448():
    reader = CheckpointReader(TINY_MODEL)
    model = LayerwiseModel(reader)
    ids = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    scales = calibrate_kv_scales(model, ids)
    assert sorted(scales) == [0, 1, 2, 3]
    # Layer 0 by hand: its input is the embedding; the latent is kv_a_layernorm(kv_a[:128]) and the rope key
    # kv_a[128:], rotated in (2i, 2i+1) pairs (each pair keeps its norm).
    layer = model.load_layer(0)
    with torch.no_grad():
        kv = layer.self_attn.kv_a_proj_with_mqa(layer.input_layernorm(model.embed(ids)))
        nope = layer.self_attn.kv_a_layernorm(kv[..., :128])
        rope = kv[..., 128:].reshape(2, 32, 16, 2).norm(dim=-1)
    assert scales[0] == pytest.approx(max(float(nope.abs().max()), float(rope.max())) / 448, rel=1e-6)


def test_refusals():
    with pytest.raises(KqError, match="not an MLA model"):
        check_mla({"model_type": "glm4_moe"})
    model = LayerwiseModel(CheckpointReader(TINY_MODEL))
    with pytest.raises(KqError, match="no KV-cache scales"):
        emulate_fp8_kv(model, "calibrated", None)


@pytest.mark.slow
def test_quantize_writes_scales_and_eval_reports_them(tmp_path, small_glm5):
    out = tmp_path / "out"
    r = run_kq("quantize", small_glm5, "--out", out, "--group-size", "32", "--device", "cpu", "--kv-cache", "fp8",
               "--calib", CALIB, "--calib-samples", "4", "--calib-seqlen", "64", "--json")
    assert r.returncode == 0, r.stderr
    assert run_kq("verify", out).returncode == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == KV_CACHE_SCHEME
    t = load_file(str(out / "kq-kv-scales.safetensors"))
    assert sorted(t) == sorted(f"model.layers.{i}.self_attn.attn_mqa.{k}_scale" for i in range(3) for k in "kv")
    assert all(v.dtype == torch.float32 and v.shape == () and float(v) > 0 for v in t.values())
    scales = read_scales(CheckpointReader(out), 3)
    assert all(t[f"model.layers.{i}.self_attn.attn_mqa.v_scale"] == scales[i] for i in range(3))
    man = json.loads((out / "kq-manifest.json").read_text())
    assert "kq-kv-scales.safetensors" in man["files"] and man["options"]["kv_cache"] == "fp8"
    # The scales came from the source model: the same calibration in process gives the same numbers.
    from kq.quantize.calibration import calibration_ids
    ids = calibration_ids(small_glm5, CheckpointReader(small_glm5).config, CALIB, 4, 64)
    want = calibrate_kv_scales(LayerwiseModel(CheckpointReader(small_glm5)), ids)
    assert scales == pytest.approx(want, rel=1e-6)

    work = shutil.copytree(out, tmp_path / "eval")
    r = run_kq("eval", work, "--against", small_glm5, "--text", EVAL_TEXT, "--seqs", "2", "--seqlen", "32",
               "--kv-cache", "fp8", "--json")
    assert r.returncode == 0, r.stderr
    kv = json.loads(r.stdout)["kv_cache"]
    assert set(kv) == {"scales", "scale-1", "calibrated", "block-128"}
    assert all(kv[m]["kl"] > 0 for m in ("scale-1", "calibrated", "block-128"))

    r = run_kq("quantize", small_glm5, "--out", tmp_path / "x", "--kv-cache", "fp8")
    assert r.returncode == 2 and "--kv-cache fp8 needs --calib" in r.stderr and not (tmp_path / "x").exists()

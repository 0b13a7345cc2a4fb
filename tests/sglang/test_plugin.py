"""kq's SGLang plugin in SGLang 0.5.23 (issue 5, CPU part), all through SGLang's own code in
the side venv: its entry-point loader, argument parser, model loader's config path, scheme
selection, shared-expert fusion rule and FusedMoE layer with its weight loader."""
from __future__ import annotations

import json

import pytest

from sglang_side import HERE, REAL_EXPERTS, run_probe, run_side, with_real_expert_count

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def tp8_ckpt(tmp_path_factory):
    """GLM-5.2 layout whose experts split over TP 8 at group 32 (I=256: 32 per rank) and EP 2."""
    from kq.synth import generate
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("tp8")
    src = generate("glm5", root / "src", seed=2, hidden=128, n_experts=8, moe_intermediate=256, num_layers=3,
                   vocab=512, intermediate=256)
    out = root / "int4"
    r = subprocess.run([sys.executable, "-m", "kq", "quantize", str(src), "--out", str(out), "--group-size", "32",
                        "--device", "cpu"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for tp, ep in ((8, 1), (8, 2)):
        r = subprocess.run([sys.executable, "-m", "kq", "shard", str(out), "--tp", str(tp), "--ep", str(ep)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def plugin_check(tp8_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("check") / "check.json"
    run_side(HERE / "check_plugin.py", tp8_ckpt, "--out", out, "--bad-split-folder", tp8_ckpt)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def plugin_probe(kq_outputs, small_glm5, tmp_path_factory):
    """Probe with SGLang's plugins loaded: kq checkpoints (as written and at the real expert
    counts), kq's output under an explicit --quantization compressed-tensors, a compressed-tensors
    checkpoint kq did not write, and an FP8 source."""
    tmp = tmp_path_factory.mktemp("pprobe")
    jobs, keys = [], []
    for fam, out in kq_outputs.items():
        real = with_real_expert_count(out, fam, tmp / f"{fam}-real")
        keys += [(fam, "small"), (fam, "real")]
        jobs += [{"folder": str(out)}, {"folder": str(real)}]
    keys.append(("glm5", "explicit-ct"))
    jobs.append({"folder": str(kq_outputs["glm5"]), "quantization": "compressed-tensors"})
    foreign = tmp / "foreign-ct"
    foreign.mkdir()
    cfg = json.loads((kq_outputs["glm5"] / "config.json").read_text())
    groups = cfg["quantization_config"]["config_groups"]
    groups["group_0"] = groups.pop("int4_experts")  # llm-compressor's naming, not kq's
    (foreign / "config.json").write_text(json.dumps(cfg))
    keys.append(("glm5", "foreign-ct"))
    jobs.append({"folder": str(foreign)})
    keys.append(("glm5", "fp8-source"))
    jobs.append({"folder": str(small_glm5)})
    return dict(zip(keys, run_probe(jobs, tmp, plugins=True)))


def _models(res):
    return [res["main"]] + ([res["draft"]] if "draft" in res else [])


def test_entry_point_loads_and_kq_parses(plugin_check):
    p = plugin_check["plugin"]
    assert p["kq_class"] == "KqConfig"
    assert p["methods_first"] == "kq"  # asked first by SGLang's override loop
    assert p["kq_in_choices"] is True
    assert p["parsed_quantization"] == "kq"  # `--quantization kq` parses


@pytest.mark.parametrize("family", list(REAL_EXPERTS))
def test_override_takes_kq_checkpoints_experts_to_kq(plugin_probe, family):
    res = plugin_probe[(family, "small")]
    for m in _models(res):
        assert (m["quantization"], m["quant_config_class"]) == ("kq", "KqConfig")
        experts = {p: v for p, v in m["modules"].items() if p.endswith("mlp.experts")}
        assert experts and all(v["method"] == "KqMoEMethod" for v in experts.values()), experts
        # Everything else: SGLang's own compressed-tensors schemes, unchanged.
        fp8 = [v for p, v in m["modules"].items() if v.get("scheme") == "CompressedTensorsW8A8Fp8"]
        assert fp8 and all(v["method"] == "CompressedTensorsLinearMethod" for v in fp8)
        assert m["weight_block_size"] == (None if family == "glm4_moe" else [128, 128])


def test_override_leaves_other_checkpoints_to_sglang(plugin_probe):
    for key, quant, cls, moe in ((("glm5", "explicit-ct"), "compressed-tensors", "CompressedTensorsConfig",
                                  "CompressedTensorsFusedMoEMethod"),
                                 (("glm5", "foreign-ct"), "compressed-tensors", "CompressedTensorsConfig",
                                  "CompressedTensorsFusedMoEMethod"),
                                 (("glm5", "fp8-source"), "fp8", "Fp8Config", None)):
        m = plugin_probe[key]["main"]
        assert (m["quantization"], m["quant_config_class"]) == (quant, cls), key
        if moe:
            assert {v["method"] for p, v in m["modules"].items() if p.endswith("mlp.experts")} == {moe}


@pytest.mark.parametrize("family", list(REAL_EXPERTS))
def test_shared_experts_kept_apart_without_flag(plugin_probe, family):
    # At the real expert counts SGLang would fuse GLM-5/GLM-4 without the plugin
    # (test_config_acceptance.py); with it, every family and the MTP draft keep them apart.
    for m in _models(plugin_probe[(family, "real")]):
        se = m["shared_experts"]
        assert se["can_fuse_shared_expert_hook"] is False
        assert se["fusion_disabled"] is True and se["num_fused_shared_experts"] == 0, (m["model_class"], se)
        assert "higher precision" in se["reason"]


@pytest.mark.parametrize("layout", ["tp8", "tp8_ep2"])
def test_tp_rank_loading_reassembles_exactly(plugin_check, layout):
    r = plugin_check[layout]
    assert r["methods"] == ["KqMoEMethod"] and r["ranks"] == 8
    # Each rank's slices, put back together, are the unsharded checkpoint tensors bit for bit.
    assert r["reassembles_exactly"] is True
    e_local = 8 if layout == "tp8" else 4
    assert r["rank0_w13_shape"] == [e_local, 2 * 256 // (8 if layout == "tp8" else 4), 128 // 8]
    # What SGLang's loader put on each rank (checkpoint layout) equals kq shard's file for that rank,
    # and the plugin used those files (they exist for this layout) with the same prepack.
    assert r["matches_kq_shard_files"] is True
    assert r["used_rank_files"] == [True]
    assert r["process_weights_matches_prepack"] is True
    # Sum over ranks of apply() (what the all-reduce does) = the unsharded reference MoE, to
    # bf16 output rounding (each rank returns bf16).
    assert r["apply_sum_max_abs_err"] <= 0.01 * r["ref_max_abs"]


def test_rank_files_replace_the_checkpoints_expert_reads(plugin_check):
    it = plugin_check["iterator"]
    n_expert_tensors = 3 * 8 * 3 * 3  # 3 MoE layers (incl. MTP) x 8 experts x gate/up/down x 3 tensors
    for kind in ("single", "threaded"):  # SGLang's default loader is the threaded one
        # kq shard wrote tp8-ep1 and tp8-ep2: SGLang's iterator then reads no routed-expert tensor.
        assert it[f"tp8-ep1-{kind}"]["experts"] == 0 and it[f"tp8-ep2-{kind}"]["experts"] == 0
        # No files for TP 4: the full checkpoint is read as usual, each tensor once.
        full = it[f"tp4-ep1-{kind}"]
        assert full["experts"] == n_expert_tensors and full["unique"] == full["total"]
        assert full["total"] - it[f"tp8-ep1-{kind}"]["total"] == n_expert_tensors
        assert it[f"tp8-ep1-{kind}"]["bytes"] < full["bytes"]
    assert it["tp4-ep1-single"] == it["tp4-ep1-threaded"]
    # The MTP draft (model.decoder) maps to the checkpoint's layer N = num_hidden_layers.
    assert plugin_check["draft_rank_files"] == {"layer": "model.layers.3.mlp.experts", "file": "ep0-tp3.safetensors"}


def test_load_refuses_a_split_kq_inspect_would_refuse(plugin_check):
    msg = plugin_check["bad_split_error"]
    assert "per rank 16 (TP 8)" in msg and "group size 32" in msg

"""`kq quantize --keep-mtp` as SGLang 0.5.23 reads it: INT4 (WNA16 Marlin MoE) for the main model's
experts, FP8 block for the MTP draft's (`model.decoder.mlp.experts`), from SGLang's own scheme
selection in the side venv (probe_config.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from sglang_side import GROUP, SMALL, run_probe

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_kept_mtp_experts_pick_fp8_and_the_rest_int4(tmp_path):
    from kq.synth import generate
    src = generate("glm5", tmp_path / "src", seed=1, **SMALL)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "kq", "quantize", str(src), "--out", str(out), "--group-size",
                        str(GROUP), "--device", "cpu", "--keep-mtp"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = run_probe([{"folder": str(out), "tp": 8}], tmp_path)[0]
    main = {p: v for p, v in res["main"]["modules"].items() if p.endswith("mlp.experts")}
    assert set(main) == {"model.layers.1.mlp.experts", "model.layers.2.mlp.experts"}
    for p, v in main.items():
        assert (v["scheme"], v["num_bits"], v["group_size"]) == ("CompressedTensorsWNA16MoE", 4, GROUP), (p, v)
    draft = res["draft"]["modules"]["model.decoder.mlp.experts"]
    assert draft["method"] == "CompressedTensorsFusedMoEMethod"
    assert (draft["scheme"], draft["strategy"], draft["block_structure"], draft["num_bits"]) == \
        ("CompressedTensorsW8A8Fp8MoE", "block", [128, 128], 8), draft
    # The shared expert still is not fused into the experts, in either model.
    assert res["main"]["shared_experts"]["fusion_disabled"] and res["draft"]["shared_experts"]["fusion_disabled"]

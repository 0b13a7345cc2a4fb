"""Which quantization configs kq's SGLang plugin claims (kq.sglang.detect; main venv)."""
from __future__ import annotations

import copy
import json

from kq.sglang.detect import is_kq_quant_config


def test_claims_kq_output_and_nothing_else(small_glm5_out, small_glm5):
    qc = json.loads((small_glm5_out / "config.json").read_text())["quantization_config"]
    assert is_kq_quant_config(qc)
    # The FP8 source: not compressed-tensors.
    assert not is_kq_quant_config(json.loads((small_glm5 / "config.json").read_text())["quantization_config"])
    # A compressed-tensors config kq did not write (llm-compressor's group naming).
    other = copy.deepcopy(qc)
    other["config_groups"]["group_0"] = other["config_groups"].pop("int4_experts")
    assert not is_kq_quant_config(other)
    # mixed-precision top-level format: not kq's (SGLang's MoE path would refuse it anyway).
    mixed = dict(qc, format="mixed-precision")
    assert not is_kq_quant_config(mixed)
    # An explicit marker is enough.
    assert is_kq_quant_config(dict(other, kq_version="0.1.0"))
    assert not is_kq_quant_config(None) and not is_kq_quant_config({})

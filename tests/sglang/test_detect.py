"""Which quantization configs kq's SGLang plugin claims (kq.sglang.detect; main venv).

Run in a subprocess: kq.sglang.detect imports compressed-tensors, which imports Triton, and
the Triton-interpreter kernel tests need to be the first to import Triton in the pytest process.
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys


def verdicts(configs: dict, tmp_path) -> dict:
    f = tmp_path / "configs.json"
    f.write_text(json.dumps(configs))
    code = ("import json, sys; from kq.sglang.detect import is_kq_quant_config as k; "
            "c = json.load(open(sys.argv[1])); print(json.dumps({n: k(v) for n, v in c.items()}))")
    r = subprocess.run([sys.executable, "-c", code, str(f)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_claims_kq_output_and_nothing_else(small_glm5_out, small_glm5, tmp_path):
    qc = json.loads((small_glm5_out / "config.json").read_text())["quantization_config"]
    other = copy.deepcopy(qc)
    other["config_groups"]["group_0"] = other["config_groups"].pop("int4_experts")  # llm-compressor's naming
    got = verdicts({
        "kq_output": qc,
        "fp8_source": json.loads((small_glm5 / "config.json").read_text())["quantization_config"],
        "foreign_ct": other,
        "mixed_precision": dict(qc, format="mixed-precision"),  # SGLang's MoE path refuses it anyway
        "marker_only": dict(other, kq_version="0.1.0"),          # an explicit marker is enough
        "empty": {},
        "none": None,
    }, tmp_path)
    assert got == {"kq_output": True, "fp8_source": False, "foreign_ct": False, "mixed_precision": False,
                   "marker_only": True, "empty": False, "none": False}

"""kq's copy of SGLang 0.5.23's default mem_fraction_static equals what SGLang's own argument
resolution gives on an H200 (143771 MiB, capability 9.0 simulated), plain and as a decode pool."""
from __future__ import annotations

import json

import pytest

from kq.sglang.kv_capacity import H200_MIB, mem_fraction_static
from sglang_side import run_side

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

SCRIPT = """
import json, sys, warnings, logging
warnings.filterwarnings("ignore"); logging.disable(logging.WARNING)
import torch
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
import sglang.srt.arg_groups.memory_hook as mh
mh.get_device_memory_capacity = lambda *a, **k: float(sys.argv[2])   # nvidia-smi's memory.total, MiB
from sglang.srt.server_args import ServerArgs
out = {}
for tp in (2, 8):
    for mode in ("null", "decode"):
        sa = ServerArgs(model_path=sys.argv[1], tp_size=tp, device="cuda", disaggregation_mode=mode)
        sa.resolve_once()
        out[f"{tp}-{mode}"] = sa.resolved_dict()["mem_fraction_static"]
print(json.dumps(out))
"""


def test_default_memory_fraction_is_sglangs(tmp_path, small_glm5_out):
    script = tmp_path / "memfrac.py"
    script.write_text(SCRIPT)
    got = json.loads(run_side(script, small_glm5_out, H200_MIB).stdout.strip().splitlines()[-1])
    for tp in (2, 8):
        assert got[f"{tp}-null"] == mem_fraction_static(tp)
        assert got[f"{tp}-decode"] == mem_fraction_static(tp, decode_pool=True)

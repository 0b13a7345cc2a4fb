"""kq's outputs, byte for byte: a refactor that changes one byte of a quantize or shard run fails here.

The sha256 of every output file of small deterministic runs (RTN on GLM-5.x, GLM-4.x and Kimi K2
layouts, GPTQ on GLM-5.x, then `kq shard --tp 2`) is pinned in output_sha256.json, computed before
the contracts moved into kq/checkpoint/contracts.py. The two manifests name the run's folders, so
they are pinned without those paths. Regenerate (only for an intended format change) with
KQ_PIN_WRITE=1 python -m pytest tests/e2e/test_output_bytes.py.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from kq_testutil import calib_text, run_kq

PINS = Path(__file__).with_name("output_sha256.json")
SMALL = dict(hidden=128, n_experts=4, num_layers=3, vocab=512)
CASES = {
    "glm5-rtn-g32": ("glm5", dict(SMALL, moe_intermediate=128, intermediate=256), ["--group-size", "32"]),
    "glm4_moe-rtn-g64-absmax": ("glm4_moe", dict(SMALL, moe_intermediate=256, intermediate=256),
                                ["--group-size", "64", "--clip", "absmax"]),
    "kimi_k2-rtn-g64": ("kimi_k2", dict(SMALL, moe_intermediate=128, intermediate=256), ["--group-size", "64"]),
    "glm5-gptq-g32": ("glm5", dict(SMALL, moe_intermediate=128, intermediate=256),
                      ["--group-size", "32", "--method", "gptq", "--calib-samples", "4", "--calib-seqlen", "64"]),
}


def _digest(rel: Path, data: bytes) -> str:
    if rel.name in ("kq-manifest.json", "manifest.json"):
        m = json.loads(data)
        m.pop("source_manifest_sha256", None)          # hash of the manifest below, which names the folder
        if isinstance(m.get("source"), dict):
            m["source"].pop("name", None)              # the source folder's path
        data = json.dumps(m, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()


def _run(case: str, root: Path) -> dict[str, str]:
    from kq.synth import generate
    family, opts, args = CASES[case]
    src = generate(family, root / "src", seed=1, **opts)
    out = root / "out"
    extra = ["--calib", calib_text(root)] if "gptq" in args else []
    r = run_kq("quantize", src, "--out", out, "--device", "cpu", *args, *extra)
    assert r.returncode == 0, r.stderr
    r = run_kq("shard", out, "--tp", "2")
    assert r.returncode == 0, r.stderr
    return {str(f.relative_to(out)): _digest(f.relative_to(out), f.read_bytes())
            for f in sorted(out.rglob("*")) if f.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_are_byte_identical(case, tmp_path):
    got = _run(case, tmp_path)
    if os.environ.get("KQ_PIN_WRITE"):
        pins = json.loads(PINS.read_text()) if PINS.exists() else {}
        pins[case] = got
        PINS.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
    want = json.loads(PINS.read_text())[case]
    assert got == want

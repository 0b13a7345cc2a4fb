"""Session fixtures for the SGLang tests (helpers in sglang_side.py)."""
from __future__ import annotations

import pytest

from sglang_side import REAL_EXPERTS, quantize, run_probe, with_real_expert_count


@pytest.fixture(scope="session")
def kq_outputs(tmp_path_factory) -> dict[str, Path]:
    """kq quantize output (group 32) of a small generated checkpoint of each family."""
    root = tmp_path_factory.mktemp("sglang-ckpts")
    return {f: quantize(f, root) for f in REAL_EXPERTS}


@pytest.fixture(scope="session")
def probe(kq_outputs, tmp_path_factory) -> dict:
    """SGLang's answers, one side-venv process for all: {(family, variant): result}.
    Variants: "small" (the output as written), "real" (real expert count), "real+flag"
    (real expert count, launched with --disable-shared-experts-fusion)."""
    tmp = tmp_path_factory.mktemp("probe")
    keys, jobs = [], []
    for fam, out in kq_outputs.items():
        real = with_real_expert_count(out, fam, tmp / f"{fam}-real")
        for variant, folder, flag in (("small", out, False), ("real", real, False), ("real+flag", real, True)):
            keys.append((fam, variant))
            jobs.append({"folder": str(folder), "tp": 8, "disable_shared_experts_fusion": flag})
    return dict(zip(keys, run_probe(jobs, tmp)))

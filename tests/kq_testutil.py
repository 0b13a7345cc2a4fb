"""Helpers shared by kq's tests (imported by name: `conftest` is ambiguous with tests/sglang/)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
TINY_MODEL = SHARED / "models" / "tiny-glm-5.2-fp8"

# A small GLM-5.2-layout checkpoint: 3 layers + MTP, 4 experts, fast to quantize on 2 cores.
SMALL_GLM5 = dict(hidden=128, n_experts=4, moe_intermediate=128, num_layers=3, vocab=512, intermediate=256)


def run_kq(*args, env=None, cwd=None, timeout=600):
    """The real CLI in a subprocess: what a user sees (stdout, stderr, exit code)."""
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "kq", *map(str, args)], capture_output=True, text=True,
                          env=e, cwd=cwd, timeout=timeout)


def calib_text(folder: Path) -> Path:
    """folder/calib.txt: 4000 words drawn (seeded) from a short sentence, enough for GPTQ's small runs."""
    import torch
    words = "in the beginning was the word and the word was with god said the preacher".split()
    g = torch.Generator().manual_seed(0)
    p = Path(folder) / "calib.txt"
    p.write_text(" ".join(words[int(i)] for i in torch.randint(0, len(words), (4000,), generator=g)))
    return p

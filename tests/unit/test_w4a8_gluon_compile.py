"""The Gluon W4A8 kernel (kq/kernels/w4a8_gluon.py) compiled for sm_90a on this CPU machine with Triton's
own ptxas, and its machine code read back: what the kernel exists for is a schedule, so the test pins
the schedule. In the K loop, the wgmma of both weight tiles are issued before the next block's converted
weights are stored, and the loop waits for the tensor cores only after those stores; nothing spills.
The kernel's numbers are checked on a Hopper GPU (tests/gpu/test_w4a8_gpu.py).

The compile runs in a child process: on a machine without a GPU the test session loads Triton under its
interpreter (tests/_triton_interpreter.py), where Gluon cannot be imported."""
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.experimental.gluon") is None:
    pytest.skip("needs Triton with Gluon", allow_module_level=True)
BIN = Path(importlib.util.find_spec("triton").origin).parent / "backends" / "nvidia" / "bin"
SIG = {"a_ptr": "*fp8e4nv", "stride_am": "i32", "as_ptr": "*fp32", "r_ptr": "*fp32", "stride_rm": "i32",
       "q_ptr": "*i32", "stride_qe": "i32", "s_ptr": "*bf16", "stride_se": "i32", "stride_sk": "i32",
       "out_ptr": "*bf16", "stride_om": "i32", "pairs_ptr": "*i32", "blk_expert_ptr": "*i32",
       "blk_start_ptr": "*i32", "blk_count_ptr": "*i32", "N": "i32", "KB": "i32", "up_offset": "i32"}
# what Triton's launcher specialises at run time: 16-byte aligned pointers, strides and sizes divisible by 16
DIV16 = [n for n in SIG if n.endswith("_ptr") or n.startswith("stride_") or n in ("N", "KB", "up_offset")]


def _compile(gated: bool, block_n: int, stages: int, cubin: Path) -> None:
    """(child process) the kernel for sm_90a with Triton's run-time specialisations, as a cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from kq.kernels.w4a8_gluon import w4a8_moe_gluon_kernel
    consts = {"A_ROW_DIV": 8 if gated else 1, "GATED": gated, "BLOCK_M": 64, "BLOCK_N": block_n, "STAGES": stages, "PREFETCH": 1}
    names = list(SIG)
    src = GluonASTSource(fn=w4a8_moe_gluon_kernel, signature={**SIG, **{k: "constexpr" for k in consts}},
                         constexprs=consts, attrs={(names.index(n),): [["tt.divisibility", 16]] for n in DIV16})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    cubin.write_bytes(k.asm["cubin"])


def _sass(tmp_path, gated: bool, block_n: int, stages: int) -> tuple[str, str]:
    if not (BIN / "nvdisasm").exists():
        pytest.skip("Triton's nvdisasm is not in this wheel")
    cubin = tmp_path / "k.cubin"
    subprocess.run([sys.executable, __file__, json.dumps([gated, block_n, stages, str(cubin)])], check=True,
                   cwd=Path(__file__).resolve().parents[2])
    sass = subprocess.run([str(BIN / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    return sass, res


def _loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body (the K loop)."""
    ins, labels, best = [], {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*\.L_x_(\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
        elif re.match(r"\s*/\*[0-9a-f]{4}\*/", line):
            ins.append(re.sub(r"/\*[0-9a-f]+\*/", "", line).strip())
    for i, t in enumerate(ins):
        m = re.search(r"BRA\s.*\.L_x_(\d+)", t)
        if m and labels.get(m.group(1), i) < i and (best is None or i - labels[m.group(1)] > best[1] - best[0]):
            best = (labels[m.group(1)], i)
    assert best, "no loop found"
    return ins[best[0]:best[1] + 1]


@pytest.mark.parametrize("gated,block_n,stages", [(True, 64, 3), (False, 128, 4)])
def test_gluon_kernel_overlaps_conversion_with_the_wgmma(tmp_path, gated, block_n, stages):
    sass, res = _sass(tmp_path, gated, block_n, stages)
    assert "STACK:0" in res, res                    # no spills
    body = _loop(sass)
    at = {name: [i for i, t in enumerate(body) if re.search(pat, t)] for name, pat in
          (("mma", r"\bQGMMA\b"), ("wait", r"WARPGROUP\.DEPBAR"), ("sts", r"\bSTS\.128\b"))}
    n_tiles = 2 if gated else 1
    assert len(at["mma"]) == 4 * n_tiles              # K = 128 per block: four k32 wgmma per tile
    assert len(at["wait"]) == 1                       # one wait for the block, the tiles in flight together
    # every converted word stored while the block's wgmma run: after the last one is issued, before the wait
    assert at["sts"] and all(at["mma"][-1] < i < at["wait"][0] for i in at["sts"])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    g, bn, st, out = json.loads(sys.argv[1])
    _compile(g, bn, st, Path(out))

"""The register-operand W4A8 kernel (kq/kernels/w4a8_rs.py) compiled for sm_90a on this CPU machine with
Triton's own ptxas, its machine code read back. What the kernel exists for is where the weights go, so
the test pins it: in the K loop every FP8 wgmma takes its A operand from registers (QGMMA R, R, gdesc),
nothing is stored to shared memory by a thread (only cp.async copies fill it), the conversion from the
lane words is the two masks (no byte permutes, no shuffles); the step is one FFMA an accumulator element (the
offset's correction comes after the loop) and one barrier a block; two 8-warp programs fit a multiprocessor
without spilling.
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
DIV16 = [n for n in SIG if n.endswith("_ptr") or n.startswith("stride_") or n in ("N", "up_offset")]


def _compile(gated: bool, wg: int, block_t: int, cubin: Path) -> None:
    """(child process) the kernel for sm_90a with Triton's run-time specialisations, as a cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from kq.kernels.w4a8_rs import w4a8_rs_kernel
    consts = {"A_ROW_DIV": 8 if gated else 1, "GATED": gated, "BLOCK_T": block_t, "WG": wg, "STAGES": 3,
              "KB_MAX": 64}
    names = list(SIG)
    src = GluonASTSource(fn=w4a8_rs_kernel, signature={**SIG, **{k: "constexpr" for k in consts}},
                         constexprs=consts, attrs={(names.index(n),): [["tt.divisibility", 16]] for n in DIV16})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4 * wg})
    cubin.write_bytes(k.asm["cubin"])


def _sass(tmp_path, *cfg) -> tuple[str, str]:
    if not (BIN / "nvdisasm").exists():
        pytest.skip("Triton's nvdisasm is not in this wheel")
    cubin = tmp_path / "k.cubin"
    subprocess.run([sys.executable, __file__, json.dumps([*cfg, str(cubin)])], check=True,
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


@pytest.mark.parametrize("gated,wg,block_t", [(True, 2, 64), (False, 4, 64), (True, 2, 32), (False, 1, 64)])
def test_weights_reach_the_fp8_wgmma_from_registers(tmp_path, gated, wg, block_t):
    sass, res = _sass(tmp_path, gated, wg, block_t)
    assert "STACK:0" in res, res                                    # no spills
    body = _loop(sass)
    stages = 3                                                      # the loop is unrolled by the ring's slots
    mma = [t for t in body if re.search(r"\bQGMMA\b", t)]
    assert len(mma) == 4 * stages                                   # K = 128 per block: four k32 wgmma
    assert all(re.search(rf"QGMMA\.64x{block_t}x32\.F32\.E4M3\.E4M3 R\d+, R\d+, gdesc", t) for t in mma), mma
    assert not [t for t in body if re.match(r"(@!?P\w+ )?STS\b", t)]           # no shared-memory round trip
    assert not [t for t in body if re.search(r"\b(SHFL|I2F|F2F)\b", t)]         # masks only, no exchanges
    assert not [t for t in body if re.match(r"(@!?P\w+ )?LDG\b", t)]           # no global load into registers
    assert len([t for t in body if "WARPGROUP.DEPBAR" in t]) == stages
    bars = [i for i, t in enumerate(body) if "BAR.SYNC" in t]
    assert len(bars) == stages                                                   # one barrier a block,
    assert all(body[i - 1].startswith("DEPBAR.LE SB0") for i in bars), bars      # right after the copies' wait
    first_copy = next(i for i, t in enumerate(body) if "LDGSTS" in t)
    assert bars[0] < first_copy                 # and before a slot is refilled
    assert not [t for t in body if re.match(r"(@!?P\w+ )?FADD\b", t)]          # the offset is not taken off here
    # the rescale: one FFMA per accumulator element (64 x block_t over 128 threads) a block
    assert len([t for t in body if re.match(r"(@!?P\w+ )?FFMA\b", t)]) == stages * block_t // 2
    # two 8-warp programs a multiprocessor (three of one warpgroup)
    assert int(re.search(r"REG:(\d+)", res).group(1)) <= (128 if wg > 1 else 168), res


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    g, w, bt, out = json.loads(sys.argv[1])
    _compile(g, w, bt, Path(out))

"""The W4A8 prefill MoE's bookkeeping on the CPU: the activation order, the int4 -> e4m3 byte-permute
conversion of w4a8_kernel (its PTX emulated bit for bit), the kernel's K-block maths on the lane layout
against a plain float64 matmul, the quantisation kernel through Triton's interpreter, the torch reference.
The compiled kernels run in tests/test_w4a8_gpu.py."""
import numpy as np
import pytest
import torch

from kq.kernels import prepack_moe, reference as w4a16_ref
from kq.kernels import w4a8
from kq.kernels.lane_layout import dequantize_lane, lane_input
from kq.kernels.layout import pack_checkpoint_nibbles


def _moe(e, h, i, seed):
    g = torch.Generator().manual_seed(seed)

    def mat(n, k):
        nib = torch.randint(0, 16, (e, n, k), generator=g)
        return pack_checkpoint_nibbles(nib), (torch.rand(e, n, k // 128, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    (p13, s13), (p2, s2) = mat(2 * i, h), mat(h, i)
    return prepack_moe(p13, s13, p2, s2, 128, lane=True)


def test_lane_order_for_the_register_operand_kernel():
    """cvt 3 (w4a8_rs.py): position 32s + 16h + 4t + i of a block holds the input of nibble 2i + h of
    word (t, wd = s), what wgmma's register fragment gets from `w & 0x0F0F0F0F` (h 0) and
    `(w >> 4) & 0x0F0F0F0F` (h 1)."""
    order = w4a8.lane_order(384, 3)
    for kb in range(3):
        for s in range(4):
            for h in range(2):
                for t in range(4):
                    for i in range(4):
                        nib = 2 * i + h
                        assert order[128 * kb + 32 * s + 16 * h + 4 * t + i] == lane_input(kb, t, s, nib % 4, nib // 4)
    assert sorted(order.tolist()) == list(range(384))
    assert sorted(v for v in w4a8.lane_order(200, 3).tolist() if v >= 0) == list(range(200))


@pytest.mark.parametrize("cvt", [1, 2])
def test_lane_order_is_the_lane_layouts_storage_order(cvt):
    order = w4a8.lane_order(384, cvt)
    for kb in range(3):
        for t in range(4):
            for wd in range(4):
                for j in range(4):
                    for i in range(2):
                        nib = j + 4 * i                         # nibble of word 4t + wd
                        pos = nib if cvt == 1 else nib // 2 + 4 * (nib % 2)     # cvt 2: 0, 2, 4, 6, 1, 3, 5, 7
                        assert order[128 * kb + 32 * t + 8 * wd + pos] == lane_input(kb, t, wd, j, i)
    assert sorted(order.tolist()) == list(range(384))
    padded = w4a8.lane_order(200, cvt)
    assert padded.numel() == 256 and (padded < 0).sum() == 56
    assert sorted(v for v in padded.tolist() if v >= 0) == list(range(200))


def _prmt(a, b, sel):
    """PTX prmt.b32 (default mode) on uint32 numpy arrays."""
    src = (b.astype(np.uint64) << 32) | a.astype(np.uint64)
    out = np.zeros_like(a, dtype=np.uint64)
    for byte in range(4):
        s = (sel >> (4 * byte)) & 0xF
        val = (src >> ((s & 7).astype(np.uint64) * 8)) & 0xFF
        val = np.where(s & 8, np.where(val & 0x80, 0xFF, 0), val)
        out |= val.astype(np.uint64) << (8 * byte)
    return out.astype(np.uint32)


def test_byte_permute_conversion_gives_e4m3_of_every_code():
    """w4a8_kernel CVT 1, instruction by instruction, over all 65536 sets of four codes."""
    x = np.arange(1 << 16, dtype=np.uint32) | (np.uint32(0xABCD) << 16)      # junk in the high half
    u = x ^ 0x8888
    p1 = _prmt(np.full_like(x, 0xCACCCED0), np.full_like(x, 0xB8C0C4C8), x)
    p2 = _prmt(np.full_like(x, 0x44403800), np.full_like(x, 0x4E4C4A48), u)
    m = _prmt(x, (x << 4).astype(np.uint32), np.full_like(x, 0x9D8C))
    out = (p1 & ~m) | p2                                                     # lop3 0xBA
    codes = (x[:, None] >> (4 * np.arange(4, dtype=np.uint32))) & 0xF
    want = (torch.from_numpy(codes.astype(np.float32)) - 8).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    got = (out[:, None] >> (8 * np.arange(4, dtype=np.uint32))) & 0xFF
    assert (got == want).all()


def test_offset_bytes_are_the_codes_times_2_to_the_minus_9():
    """w4a8_kernel CVT 2: every byte 0..15 read as e4m3 is itself * 2^-9 (subnormals 0..7, exponent 1 for
    8..15), and `w & 0x0F0F0F0F`, `(w >> 4) & 0x0F0F0F0F` give a word's nibbles 0, 2, 4, 6, 1, 3, 5, 7."""
    b = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(b.view(torch.float8_e4m3fn).double(), b.double() * 2.0 ** -9)
    w = np.random.default_rng(0).integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)
    regs = np.stack([w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F], 1)              # two registers per word
    got = torch.from_numpy(regs.view(np.uint8).reshape(-1, 8).copy()).view(torch.float8_e4m3fn).double()
    nibbles = (w[:, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    want = torch.from_numpy(nibbles[:, [0, 2, 4, 6, 1, 3, 5, 7]].astype(np.float64)) * 2.0 ** -9
    assert torch.equal(got, want)


@pytest.mark.parametrize("cvt", [1, 2])
def test_kernel_block_maths_on_the_lane_layout_equals_a_matmul(cvt):
    """What w4a8_moe_kernel does for one expert (words expanded in storage order times the activations
    in lane order, each 128-input block's product times its scale row, the row scale at the end; for
    cvt 2 the codes as c * 2^-9 in its nibble order, less the block sums r, times 512) equals the
    dequantised weights times the dequantised FP8 activations."""
    pp = _moe(2, 384, 256, 1)
    x = torch.randn(5, 384, dtype=torch.bfloat16)
    q, s, r = w4a8.quantize_rows(x, cvt)                           # kernel order, CPU path
    words = pp.w13_q[1].to(torch.int64) & 0xFFFFFFFF               # [N/8, KB, 8, 4, 4]
    nt, kb = words.shape[:2]
    codes = (words.permute(0, 2, 1, 3, 4).reshape(nt * 8, kb, 16)[..., None] >> (4 * torch.arange(8))) & 0xF
    scales = w4a8.block_scales(pp)[0][1].double()                            # [KB, N]
    a = q.double().view(5, kb, 128)
    if cvt == 1:
        codes = codes.reshape(nt * 8, kb, 128).double() - 8                 # [N, KB, 128] position p = 8 word + J
        acc = sum(torch.einsum("mp,np->mn", a[:, b], codes[:, b]) * scales[b][None, :] for b in range(kb))
    else:
        assert torch.equal(r.double(), a.sum(-1) / 64)
        codes = codes[..., [0, 2, 4, 6, 1, 3, 5, 7]].reshape(nt * 8, kb, 128).double() * 2.0 ** -9
        acc = sum((torch.einsum("mp,np->mn", a[:, b], codes[:, b]) - r[:, b, None].double())
                  * 512 * scales[b][None, :] for b in range(kb))
    got = acc * s.double()[:, None]
    qn, sn = w4a8.quantize_rows_reference(x)
    w = dequantize_lane(pp.w13_q[1:2], pp.w13_s[1:2], 384, 128, torch.float64)[0]
    want = (qn.double() * sn.double()[:, None]) @ w.T
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-9)


def test_register_operand_kernel_block_maths_equals_a_matmul():
    """What w4a8_rs_kernel does, thread by thread: lane (g, t) of warp w in k32 step s loads word (t, s)
    of its column's block (pointer + 4t + s), and its fragment registers are `w & 0x0F0F0F0F` (inputs
    32s + 4t + i) and `(w >> 4) & 0x0F0F0F0F` (32s + 16 + 4t + i), bytes read as e4m3 c * 2^-9; the
    product with the activations in cvt 3's order, less the block sums, times 512 and the scales, equals
    the dequantised weights times the dequantised FP8 activations."""
    pp = _moe(2, 384, 256, 3)
    x = torch.randn(5, 384, dtype=torch.bfloat16)
    q, s, r = w4a8.quantize_rows(x, 3)
    words = (pp.w13_q[1].to(torch.int64) & 0xFFFFFFFF).numpy().astype(np.uint32)     # [N/8, KB, 8, 4, 4]
    nt, kb = words.shape[:2]
    frag = np.zeros((nt * 8, kb, 128), dtype=np.uint8)
    for n in range(nt * 8):
        col = words[n // 8, :, n % 8].reshape(kb, 16)                                 # word 4t + wd
        for step in range(4):
            for t in range(4):
                w = col[:, 4 * t + step]
                for h, reg in enumerate((w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F)):
                    for i in range(4):
                        frag[n, :, 32 * step + 16 * h + 4 * t + i] = (reg >> (8 * i)) & 0xFF
    codes = torch.from_numpy(frag).view(torch.float8_e4m3fn).double()                 # c * 2^-9
    scales = w4a8.block_scales(pp)[0][1].double()                                      # [KB, N]
    a = q.double().view(5, kb, 128)
    acc = sum((torch.einsum("mp,np->mn", a[:, b], codes[:, b]) - r[:, b, None].double()) * 512 * scales[b][None, :]
              for b in range(kb))
    got = acc * s.double()[:, None]
    qn, sn = w4a8.quantize_rows_reference(x)
    w = dequantize_lane(pp.w13_q[1:2], pp.w13_s[1:2], 384, 128, torch.float64)[0]
    assert torch.allclose(got, (qn.double() * sn.double()[:, None]) @ w.T, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("order", [1, 2, 3])
def test_quant_rows_kernel_through_the_interpreter(order, monkeypatch):
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the interpreter shim is loaded only without a GPU")
    from kq.kernels.w4a8_kernel import quant_rows_kernel
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = (torch.randn(3, 200) * 4).to(torch.bfloat16)
    q = torch.empty(3, 256, dtype=torch.float8_e4m3fn)
    s = torch.empty(3, dtype=torch.float32)
    r = torch.full((3, 2), float("nan"))
    quant_rows_kernel[(3,)](x, x.stride(0), q, q.stride(0), s, r, r.stride(0), 200, KP=256, BLOCK=256, ORDER=order)
    cq, cs, _ = w4a8.quantize_rows(x, order)
    assert torch.allclose(s, cs, rtol=1e-6)
    # Triton 3.6's interpreter casts to fp8 its own way (about 2 % of the codes differ from torch's
    # round-to-nearest, seen up to a factor 2 off); the order is what this pins: a wrong position
    # would leave ~1/256 of the codes equal, not > 90 %
    same = (q.view(torch.uint8) == cq.view(torch.uint8)).float().mean()
    assert same > 0.9
    assert (q.float().abs().amax(-1) == 448).all()
    if order >= 2:      # the block sums of what the kernel wrote, / 64
        assert torch.allclose(r, q.float().view(3, 2, 128).sum(-1) / 64, rtol=1e-6, atol=1e-6)
    else:
        assert r.isnan().all()


def test_reference_is_w4a16_up_to_fp8_activation_error():
    pp = _moe(4, 256, 128, 2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 256, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(20)]).to(torch.int32)
    tw = torch.rand(20, 2, generator=g)
    a = w4a8.fused_moe_w4a8(x, pp, tw, ids).double()        # CPU: the reference
    b = w4a16_ref.fused_moe_w4a16(x, pp, tw, ids).double()
    err = ((a - b).norm() / b.norm()).item()
    assert 1e-3 < err < 0.08                                 # FP8 e4m3 activations: a few percent


def test_refuses_other_layouts():
    pp = _moe(2, 256, 128, 4)
    from kq.kernels.layout import PrepackedMoE
    bad = PrepackedMoE(pp.w13_q, pp.w13_s, pp.w2_q, pp.w2_s, 2, 256, 128, 64, lane=True)
    with pytest.raises(ValueError, match="lane layout at group 128"):
        w4a8.fused_moe_w4a8(torch.zeros(1, 256, dtype=torch.bfloat16), bad, torch.ones(1, 1),
                            torch.zeros(1, 1, dtype=torch.int32))
    assert not w4a8.serves(pp, torch.device("cpu"))


@pytest.mark.parametrize("quantised_for,cfg_cvt", [(1, 2), (2, 1), (2, 0), (1, 3)])
def test_a_stage_refuses_activations_quantised_for_another_conversion(quantised_for, cfg_cvt):
    """cvt 2 reads the activations in its own order with their block sums: activations quantised for
    cvt 0/1 must not reach it, nor cvt 2's reach the others (checked before any launch)."""
    pp = _moe(2, 256, 128, 5)
    xq = w4a8.quantize_rows(torch.randn(3, 256).to(torch.bfloat16), quantised_for)
    routing = tuple(torch.zeros(1, dtype=torch.int32) for _ in range(4))
    with pytest.raises(ValueError, match=f"another conversion than cvt {cfg_cvt}"):
        w4a8.gate_up(xq, pp, w4a8.block_scales(pp)[0], routing, 1, w4a8.W4A8Config(64, 64, 4, 4, cfg_cvt))


@pytest.mark.parametrize("gated,cfg", [(True, w4a8.W4A8Config(64, 64, 4, 4, 3)), (False, w4a8.W4A8Config(64, 32, 4, 4, 3)),
                                       (True, w4a8.W4A8Config(64, 96, 12, 4, 3))])
def test_register_operand_kernel_refuses_tiles_it_has_no_layout_for(gated, cfg):
    """w4a8_rs.py runs 4, 8 or 16 warps with 32 (gate+up) or 64 (down) output columns per warpgroup:
    another tile is one clear error before any launch."""
    pp = _moe(2, 256, 128, 5)
    routing = tuple(torch.zeros(1, dtype=torch.int32) for _ in range(4))
    sc13, sc2 = w4a8.block_scales(pp)
    with pytest.raises(ValueError, match="register-operand kernel takes 4, 8 or 16 warps"):
        if gated:
            w4a8.gate_up(w4a8.quantize_rows(torch.randn(3, 256).to(torch.bfloat16), 3), pp, sc13, routing, 1, cfg)
        else:
            w4a8.down(w4a8.quantize_rows(torch.randn(3, 128).to(torch.bfloat16), 3), pp, sc2, routing, cfg)

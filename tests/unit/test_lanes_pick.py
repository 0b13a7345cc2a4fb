"""cuda_lanes on the CPU: pick (host-side sizes only) chooses instances the extension builds and,
for the measured shapes, the instances the H200 runs chose (docs/kernels.md, "Instances and picks"); linear
refuses a weight in the wrong layout before anything is built."""
import pytest

from kq.kernels import cuda_lanes

SHAPES = {"glm52": (256, 6144, 2048), "kimi_tp8": (384, 7168, 256), "glm47": (160, 5120, 1536),
          "kimi": (384, 7168, 2048)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", [1, 2, 8, 16, 32, 64, 128, 192, 512, 4096])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_every_pick_is_a_built_instance(shape, tokens, group):
    e, h, i = SHAPES[shape]
    v = cuda_lanes.pick(tokens * 8, e, i // 8, -(-h // 128), True, group)
    assert v in cuda_lanes.stage_variants(True, group)
    assert cuda_lanes.pick(tokens * 8, e, h // 8, -(-i // 128), False, group) in cuda_lanes.stage_variants(False, group)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", [1, 16, 64, 128])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("gated", [True, False])
def test_pick_stage_passes_the_stage_sizes_as_the_kernel_call_does(shape, tokens, group, gated):
    """pick_stage (the benchmarks' "picked" instance) = pick with the tile and block counts of that stage."""
    e, h, i = SHAPES[shape]
    n, k = (i, h) if gated else (h, i)
    assert cuda_lanes.pick_stage(tokens * 8, e, h, i, gated, group) == cuda_lanes.pick(tokens * 8, e, n // 8,
                                                                                   -(-k // 128), gated, group)


@pytest.mark.parametrize("shape,tokens,group,want", [
    ("kimi_tp8", 1, 128, (1, 8, 4, False)),   # 128 warps: split K 8 ways (8-warp CTAs), FOLD off
    ("kimi_tp8", 1, 32, (1, 8, 4, False)),
    ("glm47", 1, 128, (1, 4, 4, False)),      # 768 warps: 8 ways would pass one wave
    ("glm52", 1, 128, (1, 1, 4, True, True)),  # group 128, up to four waves: activations through the ring
    ("glm52", 1, 32, (1, 1, 4, False)),
    ("kimi_tp8", 16, 32, (2, 1, 4, True)),    # just past one wave with one tile pair per warp: two
    ("kimi_tp8", 16, 128, (2, 1, 4, True, True)),  # just past one wave of XSM warps: two tile pairs
    ("kimi_tp8", 64, 128, (1, 1, 4, True, True)),  # 3.9 waves of XSM warps
    ("glm52", 16, 128, (1, 1, 4, True)),       # ten waves: the register sets
    ("glm52", 1, 64, (1, 1, 4, False)),        # no XSM instances below group 128: under one wave, FOLD off
    ("kimi_tp8", 64, 32, (1, 1, 4, False)),     # 3.9 waves: FOLD off
    ("glm52", 16, 32, (1, 1, 4, False)),       # ten waves, under 2 pairs per expert: FOLD off
    ("glm52", 64, 32, (2, 1, 4, True)),        # past twelve waves: two tile pairs per warp
    ("glm52", 64, 128, (1, 1, 4, True)),       # group 128: one pair (level at GLM-5.2, 8-15 % on Kimi K2)
    ("glm52", 128, 32, (2, 1, 4, True)),       # 4 pairs per expert
    ("kimi", 128, 32, (2, 1, 4, True)),        # 2.7 pairs per expert
    ("kimi", 128, 128, (1, 1, 4, True)),
    ("kimi", 64, 128, (1, 1, 4, True)),        # past twelve waves but 1.3 pairs per expert: one
    ("kimi", 64, 32, (1, 1, 4, False)),
    ("kimi", 16, 32, (1, 1, 4, False)),
    ("glm47", 16, 32, (1, 1, 4, False)),
    ("glm47", 64, 32, (1, 1, 4, True)),        # 3.2 pairs per expert: FOLD on (level)
    ("glm52", 192, 32, (1, 1, 4, True)),
    ("kimi", 16, 128, (1, 1, 4, True)),
    ("glm47", 64, 128, (1, 1, 4, True)),       # 7.3 waves
    ("glm52", 192, 128, (1, 1, 4, True)),      # above decode sizes (6 pairs per expert): one pair, as measured
])
def test_gate_up_picks_of_the_measured_shapes(shape, tokens, group, want):
    e, h, i = SHAPES[shape]
    assert cuda_lanes.pick(tokens * 8, e, i // 8, -(-h // 128), True, group) == want


@pytest.mark.parametrize("group,want", [(32, (2, 1, 4, cuda_lanes.SCALE_A)), (64, (2, 1, 4, False)),
                                        (128, (2, 1, 4, False))])
def test_down_runs_without_fold(group, want):
    """Down: FOLD off; at group 32 the scales in the weight operand (SCALE_A)."""
    e, h, i = SHAPES["glm52"]
    assert cuda_lanes.pick(512, e, h // 8, -(-i // 128), False, group) == want


@pytest.mark.parametrize("shape,tokens,want", [("kimi_tp8", 16, (2, 1, 4, 2)), ("kimi_tp8", 64, (2, 1, 4, 2)),
                                               ("glm52", 16, (2, 1, 4, 2)), ("glm52", 64, (2, 1, 4, 2)),
                                               ("kimi_tp8", 1, (2, 1, 4, 2)), ("glm52", 1, (2, 1, 4, 2))])
def test_down_picks_at_group_32(shape, tokens, want):
    """SCALE_A wherever the down stage runs unsplit at group 32 (the decode sizes of both shapes)."""
    e, h, i = SHAPES[shape]
    assert cuda_lanes.pick(tokens * 8, e, h // 8, -(-i // 128), False, 32) == want


@pytest.mark.parametrize("n,k,rows,want", [
    (12288, 6144, 1, (2, 4, 4, True)), (12288, 6144, 2, (2, 4, 4, True)), (12288, 6144, 8, (2, 4, 4)),
    (12288, 6144, 16, (2, 2, 4)), (12288, 6144, 64, (2, 1, 4)), (7168, 2048, 1, (2, 4, 4, True)),
    (4096, 7168, 1, (1, 4, 4, True)), (4096, 7168, 2, (1, 4, 4, True)), (4096, 7168, 8, (1, 4, 4)),
    (4096, 7168, 32, (2, 2, 4)),
])
def test_dense_picks_of_the_measured_shapes(n, k, rows, want):
    """The fastest dense instance in the H200 runs, for every measured shape;
    up to 2 rows its XPRE twin (faster at 1 and 2 rows, slower at 8)."""
    assert cuda_lanes.pick_dense(rows, n // 8, -(-k // 128)) == want


def test_xpre_only_while_the_rows_fit_its_shared_memory():
    """XPRE holds min(8, rows) x K activations per CTA: past XPRE_MAX_BYTES the plain twin serves."""
    assert cuda_lanes.pick_dense(2, 12288 // 8, 127) == (2, 4, 4, True)      # 2 x (127 x 256 + 32) bytes <= 64 KB
    assert cuda_lanes.pick_dense(2, 12288 // 8, 128) == (2, 4, 4)
    assert cuda_lanes.pick_dense(1, 12288 // 8, 255) == (2, 4, 4, True)
    assert cuda_lanes.pick_dense(1, 12288 // 8, 256) == (2, 4, 4)
    assert cuda_lanes.pick_dense(3, 12288 // 8, 48) == (2, 4, 4)


@pytest.mark.parametrize("rows", [1, 2, 8, 9, 16, 33, 64])
@pytest.mark.parametrize("n,k", [(12288, 6144), (7168, 2048), (4096, 7168), (256, 128), (65536, 8192)])
def test_every_dense_pick_is_a_built_instance(n, k, rows):
    assert cuda_lanes.pick_dense(rows, n // 8, -(-k // 128)) in cuda_lanes.DENSE_VARIANTS


def test_the_cuda_linear_refuses_a_tiles_layout_weight_with_one_line():
    import torch

    from kq.kernels import prepack_linear
    from kq.kernels.layout import pack_checkpoint_nibbles
    w = prepack_linear(pack_checkpoint_nibbles(torch.full((1, 16, 128), 8))[0],
                       torch.ones(16, 1, dtype=torch.bfloat16), 128)
    with pytest.raises(ValueError, match=r"^cuda_lanes.linear: the weight must be prepacked with lane=True$"):
        cuda_lanes.linear(torch.zeros(1, 128, dtype=torch.bfloat16), w)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("gated", [True, False])
def test_instance_names_are_distinct(group, gated):
    """Benchmark rows name instances by variant_name: no two instances of a stage may share a name."""
    names = [cuda_lanes.variant_name(v) for v in cuda_lanes.stage_variants(gated, group)]
    assert len(set(names)) == len(names)
    assert any(n.endswith("sa") for n in names) == (group != 128)

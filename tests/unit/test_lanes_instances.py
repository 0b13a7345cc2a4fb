"""The CUDA kernel's compiled instances come from one table (kq/kernels/lanes_variants.py): the header
moe_lanes.cuh compiles is generated from it, and cuda_lanes' variant lists are read from it."""
import re

from kq.kernels import cuda_lanes
from kq.kernels.lanes_variants import ALL, DENSE_INSTANCES, HEADER, MOE_INSTANCES, header_text, moe_instances


def test_the_compiled_header_is_generated_from_the_table():
    assert HEADER.read_text() == header_text(), "run `python -m kq.kernels.lanes_variants` and commit the header"


def test_the_header_holds_each_instance_once_per_group():
    text = HEADER.read_text()
    for g in ALL:
        block = text.split(f"#define KQ_LANES_VARIANTS_{g} ")[1].split("#define")[0]
        tries = re.findall(r"KQ_LANES_TRY\(([^)]*)\)", block)
        assert len(tries) == len(set(tries)) == sum(g in groups for _, _, groups in MOE_INSTANCES)
        assert all(t.split(", ")[2] == str(g) for t in tries)
    dense = re.findall(r"KQ_LANES_DENSE_TRY\(([^)]*)\)", text)
    assert len(dense) == len(set(dense)) == len(DENSE_INSTANCES)


def test_cuda_lanes_builds_what_the_table_lists():
    for g in ALL:
        for gated, stage in ((True, "gate_up"), (False, "down")):
            assert sorted(cuda_lanes.stage_variants(gated, g), key=repr) == sorted(moe_instances(stage, g), key=repr)
    assert cuda_lanes.DENSE_VARIANTS == DENSE_INSTANCES


def test_every_pick_is_a_built_instance():
    for group in ALL:
        for gated in (True, False):
            built = set(cuda_lanes.stage_variants(gated, group))
            for pairs in (1, 8, 64, 128, 512, 1024, 4096):
                for experts, hidden, inter in ((256, 6144, 2048), (384, 7168, 256), (384, 7168, 2048), (160, 5120, 1536)):
                    assert cuda_lanes.pick_stage(pairs, experts, hidden, inter, gated, group) in built

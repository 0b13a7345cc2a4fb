// group 64 instances of the decode MoE kernel (moe_lanes.cuh); compiled apart so the build runs in parallel
#include "moe_lanes.cuh"
KQ_LANES_ENTRY(64)

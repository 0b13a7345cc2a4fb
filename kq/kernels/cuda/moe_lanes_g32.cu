// group 32 instances of the decode MoE kernel (moe_lanes.cuh); compiled apart so the build runs in parallel
#include "moe_lanes.cuh"
KQ_LANES_ENTRY(32)

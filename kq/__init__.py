"""kq: FP8 MoE checkpoints in, INT4-expert compressed-tensors checkpoints out."""
__version__ = "0.1.0"

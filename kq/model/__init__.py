"""Layer-wise model runner: a checkpoint's own transformers modules, one decoder layer at a time."""
from kq.model.runner import LayerwiseModel

__all__ = ["LayerwiseModel"]

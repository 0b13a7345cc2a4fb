"""Stand-in for the sgl_kernel package on the GPU machine (the 535 MB CUDA wheel cannot be carried).

benchmarks/gpu_sglang.sh copies this file beside the one real file taken from sgl_kernel 0.3.21,
scalar_type.py (pure Python). On CUDA, SGLang 0.5.23 imports compiled ops from sgl_kernel at module
import time (int8_scaled_mm, moe_sum, sgl_kernel.quantization.*, ...) even in modules the check never
calls, so every other name here is a placeholder that imports fine and raises when called: a check
that reaches one fails loudly instead of using a fake.

The one op the Marlin MoE path does call, moe_sum_reduce (sum over top-k times routed_scaling_factor),
is a torch stand-in; benchmarks/sglang_check.py reports that it ran.
"""
import importlib.abc
import importlib.machinery
import sys
import types

import torch


def moe_sum_reduce(x, out, routed_scaling_factor):
    out.copy_((x.float().sum(1) * float(routed_scaling_factor)).to(out.dtype))


moe_sum_reduce._kq_stand_in = True


def _placeholder(qualname):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"{qualname} is not available on this machine (sgl_kernel stub)")
    missing.__name__ = qualname.rsplit(".", 1)[-1]
    missing._kq_placeholder = True
    return missing


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _placeholder(f"sgl_kernel.{name}")


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """sgl_kernel.<anything> other than the real files beside this one: a placeholder module."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("sgl_kernel.") or fullname == "sgl_kernel.scalar_type":
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())  # after the normal finders: scalar_type.py is found as a file first

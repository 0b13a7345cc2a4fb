"""Run Triton kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1).

Import this module before anything imports triton. Triton 3.6's interpreter turns scalar
kernel arguments into 1-element numpy arrays and calls int() on them, which numpy >= 2.4
refuses; the shim below reads the one element instead.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import triton.runtime.interpreter as _interp  # noqa: E402

_orig_patch = _interp._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _orig_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


_interp._patch_lang_tensor = _patch_lang_tensor

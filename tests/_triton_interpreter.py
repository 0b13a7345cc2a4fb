"""Load kq's Triton kernels under Triton's CPU interpreter (TRITON_INTERPRET=1).

Import this before anything imports kq.kernels.triton_ops. The variable is set only while
kq's kernel modules are defined, then restored, so Triton kernels defined later by other
code in the same process still compile normally; Triton reads it again at launch, so the
tests set it around each run (an autouse fixture).

Triton 3.6's interpreter also turns scalar kernel arguments into 1-element numpy arrays and
calls int() on them, which numpy >= 2.4 refuses; the shim below reads the one element instead.
"""
import os

_saved = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton.runtime.interpreter as _interp

    _orig_patch = _interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = _patch_lang_tensor

    import kq.kernels.triton_ops as ops  # noqa: E402,F401  (defines the kernels as interpreted functions)
    import kq.kernels.w4a8_kernel  # noqa: E402,F401
finally:
    if _saved is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved

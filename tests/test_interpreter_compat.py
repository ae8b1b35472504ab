"""triton_utils._fix_interpreter_index: Triton 3.6's interpreter converted a runtime scalar (a
1-element numpy array) to the int of a ``range`` bound with ``int(data)``, a TypeError under NumPy
>= 2.4 (triton-lang/triton#9171), so every kernel with a loop over runtime bounds failed there; the
fix (upstream #9172, ``int(data.squeeze())``) is installed on such an interpreter only."""

import sys
import types

import numpy as np
import pytest
import torch

from mtpspec.ops import triton_utils
from mtpspec.ops.triton_utils import HAS_TRITON, LazyKernel, tl

if not HAS_TRITON:
    pytest.skip("triton not installed", allow_module_level=True)


def _loop_kernel(out_ptr, n, BLOCK: tl.constexpr):
    # bounds from a program id, an int argument and tl.minimum: 1-element arrays in the interpreter
    lo = tl.program_id(0) * BLOCK
    hi = tl.minimum(lo + 4 * BLOCK, n)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(lo, hi, BLOCK):
        acc += (start + tl.arange(0, BLOCK) < hi).to(tl.int32)
    tl.store(out_ptr + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), acc)


_loop = LazyKernel(_loop_kernel)


def test_loop_over_runtime_bounds_runs(kdev):
    out = torch.full((3 * 4,), -1, dtype=torch.int32, device=kdev)
    _loop[(3,)](out, 10, BLOCK=4)
    # program p counts, per lane, the in-range elements of tiles [4p, min(4p + 16, 10)) step 4
    want = [[sum(1 for s in range(lo, min(lo + 16, 10), 4) if s + j < min(lo + 16, 10)) for j in range(4)]
            for lo in (0, 4, 8)]
    assert out.cpu().view(3, 4).tolist() == want


def _fake_interpreter(monkeypatch, fixed: bool) -> types.ModuleType:
    mod = types.ModuleType("triton.runtime.interpreter")
    if fixed:
        def _patch_lang_tensor(tensor, scope):
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
    else:
        def _patch_lang_tensor(tensor, scope):
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))
    mod._patch_lang_tensor = _patch_lang_tensor
    monkeypatch.setitem(sys.modules, "triton.runtime.interpreter", mod)
    return mod


class _Scope:
    def set_attr(self, obj, name, value):
        setattr(obj, name, value)


def test_fix_applies_to_the_old_interpreter_only(monkeypatch):
    old = _fake_interpreter(monkeypatch, fixed=False)
    assert triton_utils._fix_interpreter_index()
    assert not triton_utils._fix_interpreter_index()  # once

    class T:
        handle = types.SimpleNamespace(data=np.array([7], dtype=np.int32))

    old._patch_lang_tensor(T, _Scope())
    assert list(range(T(), 9)) == [7, 8]

    new = _fake_interpreter(monkeypatch, fixed=True)
    before = new._patch_lang_tensor
    assert not triton_utils._fix_interpreter_index() and new._patch_lang_tensor is before
    monkeypatch.delitem(sys.modules, "triton.runtime.interpreter")
    assert not triton_utils._fix_interpreter_index()  # interpreter not loaded: nothing to do

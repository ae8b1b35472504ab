"""``scatter_rows_to_slots`` (the deferred-MTP hidden-state write of the graphed verify units): the
kernel (GPU, or the Triton interpreter) and its torch form against a row-by-row loop."""

import pytest
import torch

from mtpspec.ops import slot_scatter
from mtpspec.ops.slot_scatter import scatter_rows_to_slots, scatter_rows_to_slots_ref

pytestmark = pytest.mark.usefixtures("one_thread")


def _loop(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    want = cache.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            want[s] = rows[i].to(cache.dtype)
    return want


def _case(n_real: int, n_pad: int, h: int, dtype: torch.dtype, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    num_slots = 2 * (n_real + n_pad) + 3
    slots = torch.randperm(num_slots, generator=g)[:n_real]
    slots = torch.cat([slots, torch.full((n_pad,), -1, dtype=torch.int64)])
    rows = torch.randn(n_real + n_pad, h, generator=g).to(dtype)
    cache = torch.randn(num_slots, h, generator=g).to(dtype)
    return cache.to(device), rows.to(device), slots.to(device)


@pytest.mark.parametrize("n_real,n_pad,h", [(1, 0, 8), (1, 3, 384), (5, 3, 384), (7, 1, 4100), (64, 0, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_writes_real_rows_only(kdev, n_real, n_pad, h, dtype) -> None:
    cache, rows, slots = _case(n_real, n_pad, h, dtype, kdev, seed=n_real * 31 + h)
    want = _loop(cache.cpu(), rows.cpu(), slots.cpu())
    slot_scatter._kernel._built.clear()
    scatter_rows_to_slots(cache, rows, slots)
    assert slot_scatter._kernel._built, "the kernel did not run"
    assert torch.equal(cache.cpu(), want)


@pytest.mark.parametrize("n_real,n_pad", [(1, 0), (1, 3), (4, 4)])
def test_torch_form_matches_the_loop_and_casts(no_interp, n_real, n_pad) -> None:
    cache, rows, slots = _case(n_real, n_pad, 16, torch.bfloat16, "cpu", seed=n_real + n_pad)
    rows32 = rows.float() + 0.001  # another dtype: cast on the way in
    want = _loop(cache, rows32, slots)
    scatter_rows_to_slots(cache, rows32, slots)
    assert torch.equal(cache, want)
    cache2, rows2, slots2 = _case(n_real, n_pad, 16, torch.float32, "cpu", seed=7)
    want2 = _loop(cache2, rows2, slots2)
    scatter_rows_to_slots_ref(cache2, rows2, slots2)
    assert torch.equal(cache2, want2)


def test_mismatched_shapes_are_named() -> None:
    cache = torch.zeros(8, 4)
    with pytest.raises(ValueError, match=r"rows \[n, H\].*\[8, 4\], \[2, 5\], \[2\]"):
        scatter_rows_to_slots(cache, torch.zeros(2, 5), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="slots"):
        scatter_rows_to_slots(cache, torch.zeros(2, 4), torch.zeros(3, dtype=torch.int64))
    scatter_rows_to_slots(cache, torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64))  # nothing to write
    assert torch.equal(cache, torch.zeros(8, 4))

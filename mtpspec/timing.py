"""Median wall time of a call on its device: CUDA events on a GPU, ``perf_counter`` on the CPU.

Used by the adaptive speculation policy's start-up cost table
(:func:`mtpspec.spec_decode.adaptive.measure_step_costs`) and the benchmark scripts
(``benchmarks/_timing.py``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


def median_call_ms(fn: Callable[[], Any], iters: int, warmup: int = 1, cuda: bool = False) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` timed calls after ``warmup`` untimed ones.

    Args:
        fn: the call (its result is ignored).
        iters: timed calls (>= 1).
        warmup: untimed calls first.
        cuda: time each call between two CUDA events on the current stream (the device's time,
            host gaps included only where the device waits); else the host's ``perf_counter``.

    Raises:
        ValueError: ``iters < 1``.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)

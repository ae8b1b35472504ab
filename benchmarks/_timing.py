"""Timing shared by the benchmark scripts (bench_engine_step.py, check_cuda_graphs.py).

:class:`Timer`: median milliseconds of a call, eagerly (CUDA events on the GPU, ``perf_counter``
on the CPU) and as a replayed CUDA graph; :func:`read_bandwidth`: the device's read bandwidth
(``x.sum()`` over a large bf16 tensor), the denominator of memory floors; :func:`fmt` prints an
optional figure; :func:`cuda_kernel_times`: a ``torch.profiler`` profile's GPU busy time and
per-kernel totals; :func:`kernel_counts`: its kernels' time and launches per step or replay;
:meth:`Timer.kernel_profile`: the kernels of one CUDA-graph replay.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from mtpspec.timing import median_call_ms


class Timer:
    """Median milliseconds of ``fn``: CUDA events on the GPU, perf_counter on the CPU.

    Args:
        device: where ``fn`` runs. iters: timed calls per measurement.
        warmup: untimed calls first (and before a graph capture, on a side stream).
    """

    def __init__(self, device: torch.device, iters: int, warmup: int = 3) -> None:
        self.device, self.iters, self.warmup = device, iters, warmup
        self.cuda = device.type == "cuda"

    def eager(self, fn: Callable[[], Any]) -> float:
        return median_call_ms(fn, self.iters, self.warmup, self.cuda)

    def queued(self, fn: Callable[[], Any]) -> float:
        """Milliseconds a call of ``fn`` with ``iters`` calls queued back to back between two CUDA
        events and one sync at the end (as ``triton.testing.do_bench`` times): a short call's
        launch latency hidden behind the previous call, as inside an engine step's graph; the
        host's ``perf_counter`` mean on the CPU."""
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            t0 = time.perf_counter()
            for _ in range(self.iters):
                fn()
            return (time.perf_counter() - t0) * 1e3 / self.iters
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(self.iters):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / self.iters

    def graph(self, fn: Callable[[], Any], why_chars: int = 70) -> Tuple[Optional[float], Optional[str]]:
        """``(median replay ms, None)``, or ``(None, why)`` when capture is impossible (CPU, or an
        op that synchronises with the host: the exception's first line, ``why_chars`` at most)."""
        g, why = self.capture(fn, why_chars)
        return (None, why) if g is None else (self.eager(g.replay), None)

    def capture(self, fn: Callable[[], Any], why_chars: int = 70) -> Tuple[Optional[Any], Optional[str]]:
        """``(torch.cuda.CUDAGraph of fn, None)`` after ``warmup`` calls on a side stream, or
        ``(None, why)`` as :meth:`graph` says."""
        if not self.cuda:
            return None, "CPU"
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(self.warmup):
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
        except Exception as exc:  # noqa: BLE001 - report why capture is impossible
            torch.cuda.synchronize()
            return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:why_chars]}"
        return g, None

    def kernel_profile(self, g: Any, replays: int = 50) -> Dict[str, Any]:
        """Per-replay CUPTI kernel times of the CUDA graph ``g`` (:meth:`capture`): ``{"busy_ms",
        "span_ms", "kernels": [(name, us per replay, launches per replay), ...] longest first}``;
        ``span_ms`` is first kernel start to last kernel end of one replay (median), so ``span -
        busy`` is the launch gaps inside the graph."""
        from torch.profiler import ProfilerActivity, profile
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        spans = []
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                g.replay()
                torch.cuda.synchronize()
        busy = cuda_kernel_times(prof)[0]
        starts = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0)
        per = max(1, len(starts) // replays)
        for i in range(0, per * replays, per):  # one replay's kernels are consecutive (synchronised)
            chunk = starts[i:i + per]
            spans.append((max(t for _, t in chunk) - chunk[0][0]) / 1e3)
        spans.sort()
        return {"busy_ms": busy / replays, "span_ms": spans[len(spans) // 2] if spans else None,
                "kernels": sorted(((n, us, c) for n, (us, c) in kernel_counts(prof, replays).items()),
                                  key=lambda r: -r[1])}


def read_bandwidth(device: torch.device, cpu_bytes: int = 64 << 20, warmup: int = 3) -> float:
    """Bytes per second of a read-dominated reduction (``x.sum()``) over a bf16 tensor of 4 GiB
    on a GPU, ``cpu_bytes`` on the CPU; median of 10 calls."""
    n = (4 << 30) if device.type == "cuda" else cpu_bytes
    x = torch.ones(n // 2, dtype=torch.bfloat16, device=device)
    ms = Timer(device, 10, warmup).eager(lambda: x.sum(dtype=torch.float32))
    return n / (ms / 1e3)


def fmt(x: Optional[float], d: int = 3) -> str:
    """``x`` with ``d`` decimals, ``-`` for None."""
    return "-" if x is None else f"{x:.{d}f}"


def kernel_counts(prof: Any, per: int = 1) -> Dict[str, List[float]]:
    """``{kernel name (its first 90 characters): [us, launches]}`` of a ``torch.profiler`` profile's
    CUDA kernels (inside CUDA graphs too), each divided by ``per`` (the steps or replays profiled)."""
    out: Dict[str, List[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            row = out.setdefault(e.name[:90], [0.0, 0.0])
            row[0] += e.time_range.elapsed_us() / per
            row[1] += 1.0 / per
    return out


def cuda_kernel_times(prof: Any) -> Tuple[float, Dict[str, float]]:
    """``(busy ms, {kernel name: summed ms})`` of a ``torch.profiler`` profile's CUDA kernels
    (inside CUDA graphs too, as CUPTI reports them); busy = the union of their intervals, so
    overlapping kernels count once and every gap between kernels (host or in-graph launch
    latency) counts as idle."""
    spans, by_name = [], {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            spans.append((e.time_range.start, e.time_range.end))
            by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
    spans.sort()
    busy, cur_s, cur_e = 0.0, None, None
    for s, t in spans:
        if cur_e is None or s > cur_e:
            busy += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy / 1e3, by_name

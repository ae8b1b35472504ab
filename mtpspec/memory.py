"""Telling an allocator's refusal from other errors (the KV cache, ``fp8_writer``, ``tp-demo``)."""

from __future__ import annotations


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator's refusal: Python's ``MemoryError``, torch's
    ``OutOfMemoryError`` (CUDA), or a ``RuntimeError`` saying so (the CPU allocator's "can't
    allocate memory", "out of memory", "not enough memory"; also as a rank's error re-raised by
    the launcher, which keeps the message)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    msg = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in msg for s in ("can't allocate", "out of memory", "not enough memory"))

"""Keep the engine's start-up heap out of the cyclic garbage collector's passes.

A collection of CPython's oldest generation walks every tracked container object alive, and an
engine leaves hundreds of thousands of them after start-up (modules, parameters, compiled kernels,
graph handles, the tokenizer, the block pool): the GLM-5 demo engine on a CPU holds ~194,000, one
pass over them takes ~85 ms (session 25, this repo's 2-core machine), and such passes fire at random
steps once enough new containers have piled up. An H100 trace of 256 concurrent requests
(BENCHMARKS.md, session 25) had gaps of 130-165 ms between plain-decoding steps and of 564-592 ms
in the adaptive engine's (more graphs, a bigger heap), where its steps took 10-20 ms: the size such
passes would take (not yet confirmed on the GPU by timing the passes, ``gc.callbacks``).

:func:`freeze_gc_heap` collects once and then moves every object alive into the permanent
generation (``gc.freeze()``, Python 3.7+): later passes walk only what was made after it (a step's
lists, a request's objects). Reference counting still frees frozen objects; only garbage in
reference cycles among them waits for :func:`release_gc_heap`: an ``LLM`` dropped without
``shutdown()`` (or ``with``) while it sits in a reference cycle is not collected (its finalizer
never runs) until some engine of the process releases the heap. vLLM does the same after its
engine's start-up (``freeze_gc_heap`` in its engine core and GPU worker; facts from its pull
requests #14902, #24008, #27896), as does ``mtpspec serve`` after building its app.
``MTPSPEC_GC_FREEZE=0`` turns it off. The freeze is process-wide: releasing it (``shutdown()``) also
unfreezes what the application froze itself with ``gc.freeze()``.
"""

from __future__ import annotations

import atexit
import gc
import os
import threading

_lock = threading.RLock()
_holders = 0  # engines (or servers) of this process that froze the heap and have not released it
_refreeze = False  # a release left other holders' objects unfrozen: the next freeze point freezes again
_atexit_set = False  # gc.unfreeze registered to run at exit: objects still frozen when the interpreter tears
# down are never finalized (native extensions then report them leaked, e.g. nanobind's page about Triton's objects)


def gc_freeze_enabled() -> bool:
    """``False`` when the environment sets ``MTPSPEC_GC_FREEZE`` to ``0`` / ``false`` / ``off`` / ``no``."""
    return os.environ.get("MTPSPEC_GC_FREEZE", "1").strip().lower() not in ("0", "false", "off", "no")


def freeze_gc_heap() -> bool:
    """Collect, then freeze every object alive (module docstring). Returns whether it froze (the
    caller then owes one :func:`release_gc_heap`); ``False`` under ``MTPSPEC_GC_FREEZE=0``."""
    global _holders, _refreeze, _atexit_set
    if not gc_freeze_enabled():
        return False
    with _lock:
        gc.collect()
        gc.freeze()
        _holders += 1
        _refreeze = False
        if not _atexit_set:  # the interpreter's teardown must see the objects as before the freeze
            atexit.register(gc.unfreeze)
            _atexit_set = True
    return True


def release_gc_heap() -> None:
    """Undo one :func:`freeze_gc_heap` (an engine shutting down): unfreeze everything, so that the
    collector reaches the stopped engine's reference cycles once its owner drops it. Other holders'
    objects are frozen again at the next :func:`refreeze_gc_heap` (``LLM.generate`` calls it), not
    here: the stopped engine is still referenced by its caller at this point and would be frozen
    with them."""
    global _holders, _refreeze
    with _lock:
        _holders = max(0, _holders - 1)
        gc.unfreeze()
        _refreeze = _holders > 0


def refreeze_gc_heap() -> None:
    """After a release that left other holders running: collect (the stopped engines dropped by
    now) and freeze again. A flag test otherwise; re-checked under the lock, so a finalizer that
    releases the last holder during the collection leaves nothing frozen."""
    global _refreeze
    if not _refreeze:
        return
    with _lock:
        if not _refreeze:
            return
        gc.collect()
        if _holders > 0 and _refreeze:
            gc.freeze()
        _refreeze = False


def num_gc_heap_holders() -> int:
    """How many :func:`freeze_gc_heap` calls of this process are not yet released."""
    return _holders


__all__ = ["freeze_gc_heap", "gc_freeze_enabled", "num_gc_heap_holders", "refreeze_gc_heap", "release_gc_heap"]

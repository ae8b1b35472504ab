"""The engine's start-up heap is frozen out of the cyclic collector's passes (mtpspec.engine.gc_heap)
and released at shutdown; ``MTPSPEC_GC_FREEZE=0`` turns it off."""

from __future__ import annotations

import gc

import pytest

from mtpspec import LLM, SamplingParams, demo_model_path
from mtpspec.engine import gc_heap


def _tracked_ids() -> set:
    return {id(o) for o in gc.get_objects()}  # the frozen (permanent) generation is not listed


def _small_llm() -> LLM:
    return LLM(demo_model_path("glm4_moe"), dtype="float32", device="cpu", max_num_seqs=2, max_model_len=128,
               num_kv_blocks=32)


def test_engine_start_up_objects_leave_the_collectors_passes_until_shutdown():
    held = gc_heap.num_gc_heap_holders()
    llm = _small_llm()
    try:
        assert llm._gc_frozen and gc_heap.num_gc_heap_holders() == held + 1 and gc.get_freeze_count() > 0
        engine_objects = [llm.llm_engine, llm.llm_engine.scheduler, llm.executor]
        tracked = _tracked_ids()
        assert not any(id(o) in tracked for o in engine_objects)  # a gen-2 pass does not walk them
        out = llm.generate(["1 + 1 ="], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4  # the engine works frozen
    finally:
        llm.shutdown()
    assert not llm._gc_frozen and gc_heap.num_gc_heap_holders() == held
    assert gc.get_freeze_count() == 0 and id(llm.llm_engine.scheduler) in _tracked_ids()  # everything unfrozen
    llm.shutdown()  # idempotent: releases once
    assert gc_heap.num_gc_heap_holders() == held


def test_a_release_unfreezes_and_the_next_generate_freezes_the_others_again():
    """Shutting one engine down unfreezes everything (its cycles become collectable once dropped); a
    running engine's next ``generate`` collects and freezes again."""
    held = gc_heap.num_gc_heap_holders()
    a, b = _small_llm(), _small_llm()
    try:
        a.shutdown()
        assert gc_heap.num_gc_heap_holders() == held + 1 and gc.get_freeze_count() == 0
        assert id(b.llm_engine.scheduler) in _tracked_ids()
        b.generate(["2 +"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        assert gc.get_freeze_count() > 0 and id(b.llm_engine.scheduler) not in _tracked_ids()
    finally:
        a.shutdown()
        b.shutdown()
    assert gc_heap.num_gc_heap_holders() == held


class _ReleasesWhenCollected:
    """A holder in a reference cycle whose finalizer releases the heap (an ``LLM`` dropped without
    ``shutdown()``), collected by the re-freeze's own ``gc.collect()``."""

    def __init__(self):
        self.me, self.held = self, gc_heap.freeze_gc_heap()
        assert self.held

    def release(self):
        if self.held:
            self.held = False
            gc_heap.release_gc_heap()

    def __del__(self):
        self.release()


def test_a_holder_released_during_the_refreeze_collection_leaves_nothing_frozen():
    if gc_heap.num_gc_heap_holders():
        pytest.skip("another engine of this process holds the heap")
    keep = _ReleasesWhenCollected()
    dropped = _ReleasesWhenCollected()
    keep.__dict__.pop("me")  # keep: acyclic, released explicitly below
    del dropped  # cyclic garbage, frozen: nothing collects it yet
    assert gc_heap.num_gc_heap_holders() == 2
    keep.release()  # unfreeze, re-freeze pending (dropped still counts)
    gc_heap.refreeze_gc_heap()  # its collection finalizes dropped, which releases the last holder
    assert gc_heap.num_gc_heap_holders() == 0 and gc.get_freeze_count() == 0


@pytest.mark.parametrize("off", ["0", "false", "OFF", " no "])
def test_freezing_can_be_turned_off(monkeypatch, off):
    monkeypatch.setenv("MTPSPEC_GC_FREEZE", off)
    held, frozen = gc_heap.num_gc_heap_holders(), gc.get_freeze_count()
    assert not gc_heap.gc_freeze_enabled() and not gc_heap.freeze_gc_heap()
    llm = _small_llm()
    try:
        assert not llm._gc_frozen and gc_heap.num_gc_heap_holders() == held
        if held == 0:
            assert gc.get_freeze_count() == frozen == 0
    finally:
        llm.shutdown()
    assert gc_heap.num_gc_heap_holders() == held


def _rank_heap(runner) -> tuple:
    """(objects frozen, the rank's model runner outside the collector's passes) on a rank."""
    return gc.get_freeze_count(), id(runner) not in _tracked_ids()


def test_spawned_ranks_freeze_their_heap_after_start_up():
    with LLM(demo_model_path("glm4_moe"), tensor_parallel_size=2, dtype="float32", device="cpu", max_num_seqs=2,
             max_model_len=128, num_kv_blocks=32) as llm:
        ranks = llm.collective_rpc(_rank_heap)
    assert len(ranks) == 2 and all(frozen > 0 and runner_frozen for frozen, runner_frozen in ranks), ranks


def test_a_process_that_exits_with_its_engine_frozen_tears_down_cleanly():
    """The freeze is undone at exit (atexit): objects still frozen at teardown are never finalized,
    and nanobind (Triton's bindings) then prints a page of "leaked instances / types / functions"."""
    import subprocess
    import sys
    code = ("from mtpspec import LLM, SamplingParams, demo_model_path\n"
            "llm = LLM(demo_model_path(), dtype='float32', device='cpu', max_num_seqs=2, max_model_len=128,\n"
            "          num_kv_blocks=8, speculative_config={'method': 'mtp', 'num_speculative_tokens': 1})\n"
            "llm.generate(['1 +'], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)\n"
            "import gc; print('frozen', gc.get_freeze_count() > 0)\n")  # no shutdown(): exit with it frozen
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "frozen True" in p.stdout, p.stderr[-2000:]
    assert "leaked" not in p.stderr, p.stderr[-2000:]

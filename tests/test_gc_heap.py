"""The engine's start-up heap is frozen out of the cyclic collector's passes (mtpspec.engine.gc_heap)
and released at shutdown; ``MTPSPEC_GC_FREEZE=0`` turns it off."""

from __future__ import annotations

import gc

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
    if held == 0:  # no other engine of this process holds the heap: nothing stays frozen
        assert gc.get_freeze_count() == 0
        assert id(llm.llm_engine.scheduler) in _tracked_ids()
    llm.shutdown()  # idempotent: releases once
    assert gc_heap.num_gc_heap_holders() == held


def test_release_refreezes_while_another_holder_runs(monkeypatch):
    held = gc_heap.num_gc_heap_holders()
    assert gc_heap.freeze_gc_heap() and gc_heap.freeze_gc_heap()
    try:
        assert gc_heap.num_gc_heap_holders() == held + 2
        gc_heap.release_gc_heap()
        assert gc_heap.num_gc_heap_holders() == held + 1 and gc.get_freeze_count() > 0
    finally:
        gc_heap.release_gc_heap()
    assert gc_heap.num_gc_heap_holders() == held
    if held == 0:
        assert gc.get_freeze_count() == 0


def test_freezing_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("MTPSPEC_GC_FREEZE", "0")
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

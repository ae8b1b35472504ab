"""Deferred MTP KV writes (issue 18: a ``k = 0`` step costs nothing beyond plain decoding).

Under adaptive speculation a step that proposes no drafts runs no MTP pass; its rows' target
hidden states go to a paged cache and the next drafting step writes the skipped MTP entries
first (``spec_decode/deferred_mtp.py``). Contracts, each against an independent reference:

* greedy tokens equal plain greedy decoding, and every draft equals the draft of the same
  engine with deferral off under the same choice of k (so the caught-up MTP KV entries are the
  ones the k = 0 KV-only pass writes): async scheduling (the lag's last token pending on the
  device), chunked prefill and chunked catch-up, prefix-cache hits on blocks whose MTP entries
  were deferred, preemptions, n > 1 siblings, static graph buffers, two MTP layers, GLM-5 (DSA:
  indexer keys, index sharing), tp 2 on gloo ranks;
* a deferring k = 0 step runs no MTP forward and no KV-only pass, and keeps exactly the target's
  hidden states of its rows;
* the block records and the hit's ``mtp_tokens``; the lag chunking; the sizing counts the cache;
  configuration errors.
"""

from __future__ import annotations

import pytest
import torch

from test_adaptive_spec import Scripted, _table
from test_engine_fixtures import make_model, mixed_prompts, token_prompts

from mtpspec import LLM, SamplingParams
from mtpspec.config import SpeculativeConfig
from mtpspec.engine.block_manager import BlockManager
from mtpspec.engine.sequence import Sequence
from mtpspec.spec_decode import deferred_mtp
from mtpspec.spec_decode.deferred_mtp import CATCH_UP_CHUNK_ROWS, MTPHiddenStateCache, lag_rows, sequence_lag
from mtpspec.step_io import SeqInput, StepInput

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPT = [0, 0, 0, 3, 0, 0, 0, 0, 2, 0, 1, 0, 0, 3, 3, 0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_defer"))
    _, cfg = make_model(path, seed=11, num_mtp_layers=2)
    table = str(tmp_path_factory.mktemp("costs") / "costs.json")
    _table(sizes=(1, 2, 4)).save(table)
    return path, cfg, table


def _run(path, table, script, defer, prompts, k=3, n=16, spec=None, params=None, hits=None, **kw):
    """``(tokens, drafts, catch-up rows, metrics)`` of one engine under a scripted choice of k;
    ``drafts``: (request id, output length) -> the drafts the sequence got there."""
    kw = {"max_model_len": 64, "block_size": 4, "max_num_seqs": 4, "seed": 0, "num_kv_blocks": 256,
          "graph_mode": "off", "device": "cpu", **kw}  # CPU: float32 GEMMs whose bits do not depend on the row count
    spec = {"num_speculative_tokens": k, "adaptive": True, "adaptive_cost_table": table, **(spec or {})}
    drafts = {}
    with LLM(path, speculative_config=spec if k else None, **kw) as llm:
        eng = llm.llm_engine
        if k:
            eng.defer_mtp_kv = defer
            eng.spec_policy = Scripted(script)

            def hook(seq, d):
                drafts[(seq.request_id, len(seq.output_token_ids))] = tuple(d)
                return d
            eng.draft_hook = hook
        if hits is not None:
            bm = eng.scheduler.block_manager
            find = bm.find_cache_hit

            def spy(seq, find=find):
                hit = find(seq)
                hits.append((hit.num_tokens, hit.mtp_tokens))
                return hit
            bm.find_cache_hit = spy
        params = params or SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        toks = [[c.token_ids for c in o.outputs] for o in outs]
        rows = llm.collective_rpc(_catch_up_rows)
        return toks, drafts, rows, eng.get_metrics()


def _catch_up_rows(runner) -> int:
    return runner.num_mtp_catch_up_rows


def _check(want, deferred, eager, min_common=20, min_equal=1.0):
    toks, got, rows, metrics = deferred
    assert toks == want  # lossless
    assert eager[0] == want
    assert all(r > 0 for r in rows) and eager[2] == [0] * len(rows)  # deferral (and catch-up) happened
    assert metrics["num_mtp_catch_up_tokens"] == rows[0] and eager[3]["num_mtp_catch_up_tokens"] == 0
    common = [key for key in got if key in eager[1]]
    assert len(common) >= min_common
    differ = [key for key in common if got[key] != eager[1][key]]
    assert len(differ) <= (1.0 - min_equal) * len(common), differ


def _shared_prefix_prompts(vocab):
    base = mixed_prompts(8, vocab, seed=5)
    head = base[1][:13]  # 13 shared tokens: three full blocks of 4 and one more
    return [head + p[:3] for p in base[2:6]] + [head + base[6][:5], base[0], head + base[7][:2]]


@pytest.mark.parametrize("case", ["async", "sync", "chunked", "prefix", "preempt", "static", "static1", "cuda"])
def test_deferred_entries_give_the_drafts_of_eager_kv_writes_and_stay_lossless(tiny, case, monkeypatch) -> None:
    """``cuda``: CUDA graphs on a GPU (the catch-up's eager pass inside graphed steps); there the GEMM
    kernel picked per row count moves float32 logits by an ulp, so 90% of the drafts must agree (a
    missing catch-up agrees on ~20%)."""
    path, cfg, table = tiny
    prompts = mixed_prompts(6, cfg.vocab_size, seed=7)
    kw, hits, script, min_equal = {}, None, SCRIPT, 1.0
    if case == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        kw.update(device="cuda", graph_mode="cuda")
        min_equal = 0.9
    if case == "sync":
        kw["async_scheduling"] = False
    if case == "chunked":  # 20-token prompts in chunks of 5, catch-ups in chunks of 5 rows
        kw.update(max_num_batched_tokens=5, enable_chunked_prefill=True, max_num_seqs=1)
        monkeypatch.setattr(deferred_mtp, "CATCH_UP_CHUNK_ROWS", 0)  # chunks of max_num_batched_tokens rows
    if case == "prefix":
        # the first two requests run at k = 0 to the end: their cached blocks hold no MTP entries
        prompts, kw["max_num_seqs"], hits, script = _shared_prefix_prompts(cfg.vocab_size), 2, [], [0] * 18 + SCRIPT
    if case == "preempt":
        kw["num_kv_blocks"] = 18
    if case == "static":
        kw["graph_mode"] = "static"
    if case == "static1":  # one sequence at a time: its prompts run the single-sequence prefill units (pverify)
        kw.update(graph_mode="static", max_num_seqs=1)
    want = _run(path, table, script, True, prompts, k=0, **kw)[0]
    deferred = _run(path, table, script, True, prompts, hits=hits, **kw)
    eager = _run(path, table, script, False, prompts, **kw)
    _check(want, deferred, eager, min_common=8 if case in ("chunked", "prefix") else 20, min_equal=min_equal)
    if case == "prefix":  # some hits hold deferred blocks: the new sequence caught them up itself
        assert deferred[3]["prefix_cache_hits"] > 0
        assert any(m < t for t, m in hits) and any(m > 0 for t, m in hits), hits
    if case == "preempt":
        assert deferred[3]["num_preemptions"] > 0


def test_siblings_of_a_deferred_prompt_catch_up_its_shared_blocks(tiny) -> None:
    """n = 3 children fork child 0's prompt blocks, written while k = 0 deferred their MTP entries."""
    path, cfg, table = tiny
    prompts = mixed_prompts(3, cfg.vocab_size, seed=8)
    params = SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    want = _run(path, table, SCRIPT, True, prompts, k=0, params=params)[0]
    deferred = _run(path, table, [0, 0, 3, 0, 2, 3], True, prompts, params=params)
    eager = _run(path, table, [0, 0, 3, 0, 2, 3], False, prompts, params=params)
    _check(want, deferred, eager, min_common=10)


def test_glm5_dsa_with_index_sharing(tmp_path) -> None:
    """GLM-5 architecture (MLA + DSA indexer keys in the MTP layer, index sharing on)."""
    path, table = str(tmp_path / "m"), str(tmp_path / "costs.json")
    _, cfg = make_model(path, seed=3, family="glm_moe_dsa")
    _table(sizes=(1, 2, 4)).save(table)
    prompts = mixed_prompts(5, cfg.vocab_size, seed=9)
    spec = {"index_share_for_mtp_iteration": True}
    want = _run(path, table, SCRIPT, True, prompts, k=0)[0]
    _check(want, _run(path, table, SCRIPT, True, prompts, spec=spec),
           _run(path, table, SCRIPT, False, prompts, spec=spec))


def test_glm5_with_the_triton_kernels_under_the_interpreter(tmp_path, interp) -> None:
    """The same with the GPU path's kernels (latent and indexer-key writes, sparse MLA, the
    indexer) run by the Triton interpreter: the catch-up's and the split first pass's own layouts."""
    path, table = str(tmp_path / "m"), str(tmp_path / "costs.json")
    _, cfg = make_model(path, seed=3, family="glm_moe_dsa")
    _table(sizes=(1, 2, 4)).save(table)
    prompts = mixed_prompts(3, cfg.vocab_size, seed=9)
    spec = {"index_share_for_mtp_iteration": True}
    want = _run(path, table, SCRIPT, True, prompts, k=0, n=8)[0]
    _check(want, _run(path, table, SCRIPT, True, prompts, spec=spec, n=8),
           _run(path, table, SCRIPT, False, prompts, spec=spec, n=8), min_common=3)


def test_tp2_gloo_ranks(tiny) -> None:
    path, cfg, table = tiny
    prompts = mixed_prompts(5, cfg.vocab_size, seed=10)
    want = _run(path, table, SCRIPT, True, prompts, k=0)[0]
    kw = {"tensor_parallel_size": 2, "fuse_allreduce_rmsnorm": True}
    _check(want, _run(path, table, SCRIPT, True, prompts, **kw), _run(path, table, SCRIPT, False, prompts, **kw))


def _spied_deferring_engine(tiny, graph_mode, script, num_prompts, seed, max_tokens):
    """An adaptive ``LLM`` (CPU, sync scheduling) under a scripted choice of k with ``num_prompts`` requests
    queued, their prompts, and the lists its steps fill: the target's outputs and the slots of each eager
    hidden-state write."""
    path, cfg, table = tiny
    spec = {"num_speculative_tokens": 3, "adaptive": True, "adaptive_cost_table": table}
    llm = LLM(path, speculative_config=spec, max_model_len=48, block_size=4, max_num_seqs=4, num_kv_blocks=64,
              graph_mode=graph_mode, async_scheduling=False, device="cpu")
    eng, runner = llm.llm_engine, llm.llm_engine.executor.runner
    eng.spec_policy = Scripted(script)
    target_out, writes = [], []
    runner.target.register_forward_hook(lambda mod, args, out: target_out.append(out.clone()))
    write = runner.hidden_cache.write
    runner.hidden_cache.write = lambda h, slots: (writes.append(slots.clone()), write(h, slots))[1]
    prompts = mixed_prompts(num_prompts, cfg.vocab_size, seed=seed)
    for i, p in enumerate(token_prompts(prompts)):
        eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), str(i))
    return llm, prompts, target_out, writes


def test_a_deferring_k0_step_runs_no_mtp_pass_and_keeps_the_target_hidden_states(tiny) -> None:
    cfg = tiny[1]
    llm, prompts, target_out, writes = _spied_deferring_engine(tiny, "off", [0, 0, 3, 0], 2, 1, 12)
    with llm:
        eng = llm.llm_engine
        runner = eng.executor.runner
        calls = []
        runner.mtp.register_forward_hook(lambda mod, args, out: calls.append("forward"))
        kv_only = runner.mtp.forward_kv_only
        runner.mtp.forward_kv_only = lambda *a, **k: (calls.append("kv_only"), kv_only(*a, **k))[1]
        per_step, caught_up = [], []
        cache = runner.hidden_cache.kv_cache.view(-1, cfg.hidden_size)
        while eng.has_unfinished_requests():
            calls.clear(), writes.clear(), target_out.clear()
            eng.step()
            per_step.append((list(calls), len(writes)))
            caught_up.append(runner.num_mtp_catch_up_rows)
            if writes:  # exactly the target's hidden states of the step's rows, at their slots
                assert torch.equal(cache[writes[0]], target_out[0])
    # steps 0 (prefill) and 1 (one decode row each) at k = 0: no MTP call at all, hidden states kept
    assert per_step[0] == ([], 1) and per_step[1] == ([], 1)
    # step 2 proposes 3: KV-only catch-up of both layers (positions 0 .. prompt), then the first pass
    assert per_step[2][1] == 0 and per_step[2][0][:2] == ["kv_only", "kv_only"] and "forward" in per_step[2][0]
    assert caught_up[:3] == [0, 0, sum(len(p) + 1 for p in prompts)]
    assert per_step[3] == ([], 1)


def test_a_graphed_deferring_decode_step_writes_the_hidden_states_inside_its_verify_unit(tiny) -> None:
    """Static graph buffers: a pure-decode k = 0 step's verify unit writes its rows' target hidden states
    (no eager write after it; ``wrote_hidden``), exactly at the rows' slots; prompt steps (prefill units,
    mixed steps) write them eagerly."""
    cfg = tiny[1]
    llm, _, target_out, writes = _spied_deferring_engine(tiny, "static", [0] * 40, 3, 2, 8)
    with llm:
        eng = llm.llm_engine
        runner, fwd = eng.executor.runner, eng.executor.runner.fwd
        cache = runner.hidden_cache.kv_cache.view(-1, cfg.hidden_size)
        graphed = eager = 0
        while eng.has_unfinished_requests():
            writes.clear(), target_out.clear()
            eng.step()
            if fwd.active is not None:  # a pure-decode step through the static buffers
                graphed += 1
                b = fwd.num_seqs
                assert fwd.wrote_hidden and writes == []
                assert torch.equal(cache[fwd.slots[:b]], target_out[0][:b])
            else:
                eager += 1
                assert not fwd.wrote_hidden and len(writes) == 1
    assert graphed >= 5 and eager >= 1


def test_with_deferral_off_a_k0_step_writes_its_mtp_entries_and_keeps_no_hidden_states(tiny) -> None:
    path, cfg, table = tiny
    spec = {"num_speculative_tokens": 3, "adaptive": True, "adaptive_cost_table": table,
            "adaptive_defer_mtp_kv": False}
    with LLM(path, speculative_config=spec, max_model_len=48, block_size=4, max_num_seqs=4, num_kv_blocks=64,
             graph_mode="off", device="cpu") as llm:
        runner = llm.llm_engine.executor.runner
        assert runner.hidden_cache is None and not llm.llm_engine.defer_mtp_kv
        assert all(not isinstance(layer, MTPHiddenStateCache) for layer in runner.layers)


def test_kv_sizing_counts_the_hidden_state_cache_and_block_copies_carry_it(tiny) -> None:
    from mtpspec.engine import kv_cache
    path, cfg, table = tiny
    spec = {"num_speculative_tokens": 3, "adaptive": True, "adaptive_cost_table": table}
    with LLM(path, speculative_config=spec, max_model_len=48, block_size=4, num_kv_blocks=16, max_num_seqs=4,
             graph_mode="off", device="cpu") as llm:
        runner = llm.llm_engine.executor.runner
        cache = runner.hidden_cache
        assert cache in runner.layers and cache.kv_cache.shape == (16, 4, cfg.hidden_size)
        per_block = kv_cache.bytes_per_block(runner.layers, 4, runner.cache_dtype)
        others = kv_cache.bytes_per_block([x for x in runner.layers if x is not cache], 4, runner.cache_dtype)
        assert per_block - others == 4 * cfg.hidden_size * cache.kv_cache.element_size()
        cache.kv_cache[3].normal_()
        kv_cache.copy_blocks(runner.layers, [(3, 9)], cache.kv_cache.device)
        assert torch.equal(cache.kv_cache[9], cache.kv_cache[3])


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3", "glm_moe_dsa"])
def test_catch_up_chunks_and_the_memory_profile_s_kv_only_pass_writes_nothing(tmp_path, family) -> None:
    """Catch-ups run in chunks of ``max(max_num_batched_tokens, CATCH_UP_CHUNK_ROWS)`` rows; the CUDA
    memory profile runs the KV-only pass over that many rows before any cache is attached, with no
    metadata (here: the caches detached for the pass, as then), which must run and write nothing."""
    path, table = str(tmp_path / "m"), str(tmp_path / "costs.json")
    _, cfg = make_model(path, seed=4, family=family)
    _table(sizes=(1, 2, 4)).save(table)
    spec = {"num_speculative_tokens": 2, "adaptive": True, "adaptive_cost_table": table}
    with LLM(path, speculative_config=spec, max_model_len=48, block_size=4, num_kv_blocks=16, max_num_seqs=4,
             graph_mode="off", device="cpu") as llm:
        runner = llm.llm_engine.executor.runner
        assert runner.catch_up_chunk_rows == max(runner.scheduler_config.max_num_batched_tokens, CATCH_UP_CHUNK_ROWS)
        caches = [layer.kv_cache for layer in runner.layers]
        for c in caches:
            c.normal_()
        before = [c.clone() for c in caches]
        for layer in runner.layers:
            layer.kv_cache = None
        n = 37
        try:
            runner.proposer.write_kv_rows(torch.randint(0, cfg.vocab_size, (n,)), torch.arange(n),
                                          torch.randn(n, cfg.hidden_size), None)
        finally:
            for layer, c in zip(runner.layers, caches):
                layer.kv_cache = c
        assert all(torch.equal(a, b) for a, b in zip(before, caches))


# ------------------------------------------------------------------------------ host-side pieces
def _seq(tokens, rid="r"):
    return Sequence(rid, None, tokens, SamplingParams(), 0, 0.0)


def test_block_records_and_hits_stop_at_the_first_block_not_fully_written() -> None:
    bm = BlockManager(16, 4, watermark=0.0, enable_caching=True)
    a = _seq(list(range(10, 24)))  # 14 tokens: blocks 0-2 full, cached once the token after is known
    bm.allocate(a, 16)
    a.num_computed_tokens, a.mtp_len = 13, 6  # positions 6.. computed at k = 0: entries deferred
    bm.cache_full_blocks(a)
    b0, b1, b2 = a.block_table[:3]
    assert [bm.pool.mtp_upto[b] for b in (b0, b1, b2)] == [4, 2, 0]
    b = _seq(list(range(10, 24)) + [99], "b")
    hit = bm.find_cache_hit(b)  # block 1's positions 6, 7 and all of block 2's hold hidden states
    assert (hit.blocks, hit.copy_src, hit.num_tokens, hit.mtp_tokens) == ([b0, b1, b2], None, 12, 6)
    bm.allocate(b, 20, hit)
    assert (b.num_computed_tokens, b.mtp_len) == (12, 6)
    a.mtp_len = 13  # a's catch-up: every block's entries written
    bm.cache_full_blocks(a)
    assert [bm.pool.mtp_upto[x] for x in (b0, b1, b2)] == [4, 4, 4]
    hit = bm.find_cache_hit(_seq(list(range(10, 24)) + [98], "b2"))
    assert (hit.blocks, hit.num_tokens, hit.mtp_tokens) == ([b0, b1, b2], 12, 12)
    c = _seq(list(range(10, 22)), "c")  # ends at a block boundary: copy of block 2, its last row recomputed
    hit = bm.find_cache_hit(c)
    assert (hit.copy_src, hit.num_tokens, hit.mtp_tokens) == (b2, 11, 11)
    # a block freed and allocated anew forgets its record
    bm.free(a), bm.free(b)
    bm.reset_prefix_cache()
    fresh = [bm.pool.allocate() for _ in range(16)]
    assert all(bm.pool.mtp_upto[x] == 0 for x in fresh)


def test_a_hit_ends_before_a_block_written_by_drafting_after_deferred_ones(tiny) -> None:
    """Found by review: X and Y share a 9-token prompt and prefill in one step at k = 0 (X's blocks are
    cached, Y's copies stay private). X finishes at k = 0 (its blocks hold no MTP entries), Y drafts
    on, and its third block (written by drafting: no hidden states kept) joins the cache after X's
    two. Z's prompt extends Y's text: a hit through all three blocks would catch up Y's block from
    hidden states never written. The hit goes through X's two blocks (hidden states kept) and ends
    before Y's; Z's drafts then equal those of the engine without deferral."""
    path, cfg, table = tiny
    prompt = [5, 17, 33, 41, 8, 9, 60, 71, 23]

    def run(defer):
        spec = {"num_speculative_tokens": 3, "adaptive": True, "adaptive_cost_table": table}
        with LLM(path, speculative_config=spec, max_model_len=64, block_size=4, max_num_seqs=4, seed=0,
                 num_kv_blocks=256, graph_mode="off", async_scheduling=False, device="cpu") as llm:
            eng = llm.llm_engine
            eng.defer_mtp_kv = defer
            eng.spec_policy = Scripted([0] + [3] * 100)
            drafts, hits, outs = {}, [], {}

            def hook(seq, d):
                drafts[(seq.request_id, len(seq.output_token_ids))] = tuple(d)
                return d
            eng.draft_hook = hook
            bm = eng.scheduler.block_manager
            find = bm.find_cache_hit
            bm.find_cache_hit = lambda seq: (lambda h: (hits.append((seq.request_id, h.num_tokens, h.mtp_tokens)),
                                                        h)[1])(find(seq))

            def drain():
                while eng.has_unfinished_requests():
                    for o in eng.step():
                        outs[o.request_id] = o.outputs[0].token_ids
            eng.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1,
                                                                          ignore_eos=True), "X")
            eng.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8,
                                                                          ignore_eos=True), "Y")
            drain()
            z = prompt + list(outs["Y"][:4]) + [44]
            eng.add_request({"prompt_token_ids": z}, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                            "Z")
            drain()
            return outs, {key: d for key, d in drafts.items() if key[0] == "Z"}, hits

    got, got_drafts, got_hits = run(True)
    want, want_drafts, want_hits = run(False)
    assert got == want and len(want_drafts) >= 3 and got_drafts == want_drafts
    # X's two blocks hold no MTP entry (hidden states only): the hit goes through them and stops before Y's,
    # written by drafting (no hidden states); Z catches X's up
    assert ("Z", 12, 12) in want_hits and ("Z", 8, 0) in got_hits


def test_fork_hit_carries_the_source_lag() -> None:
    bm = BlockManager(16, 4, watermark=0.0)
    src = _seq(list(range(10, 21)))  # 11 prompt tokens
    bm.allocate(src, 12)
    src.num_computed_tokens, src.mtp_len = 11, 5
    hit = bm.fork_hit(src, 11)
    assert (hit.num_tokens, hit.mtp_tokens) == (10, 5)
    src.mtp_len = 11
    assert bm.fork_hit(src, 11).mtp_tokens == 10


def _si(start, lag, blocks, rid="x"):
    toks = list(range(100, 100 + lag - 1))
    return SeqInput([7], start, blocks, False, mtp_lag=lag, mtp_lag_token_ids=toks, request_id=rid)


def test_lag_rows_chunks_in_batch_order_and_checks_the_lag() -> None:
    step = StepInput([_si(9, 7, [0, 1, 2]), _si(3, 0, [3]), _si(5, 5, [4, 5])])
    assert lag_rows(step, 100) == [[(0, 2, 9), (2, 0, 5)]]
    assert lag_rows(step, 4) == [[(0, 2, 6)], [(0, 6, 9), (2, 0, 1)], [(2, 1, 5)]]
    assert lag_rows(StepInput([_si(3, 0, [3])]), 4) == []
    with pytest.raises(ValueError, match=r"sequence 0 \('bad'\): mtp_lag=4 needs 0 < mtp_lag <= start_position=3"):
        lag_rows(StepInput([_si(3, 4, [3], "bad")]), 8)
    bad = _si(9, 3, [0, 1, 2])
    bad.mtp_lag_token_ids = [1]
    with pytest.raises(ValueError, match="mtp_lag - 1 host tokens, got 1"):
        lag_rows(StepInput([bad]), 8)
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        lag_rows(step, 0)
    assert sequence_lag(3, 7, list(range(20, 40))) == (4, [24, 25, 26])
    assert sequence_lag(7, 7, list(range(20, 40))) == (0, [])


def test_config_errors() -> None:
    for value in (False, True):  # the key itself needs adaptive, whatever its value
        with pytest.raises(ValueError, match="adaptive_defer_mtp_kv is given but adaptive is false"):
            SpeculativeConfig(num_speculative_tokens=2, adaptive_defer_mtp_kv=value)
    assert SpeculativeConfig(num_speculative_tokens=2, adaptive=True).defers_mtp_kv
    assert not SpeculativeConfig(num_speculative_tokens=2, adaptive=True, adaptive_defer_mtp_kv=False).defers_mtp_kv
    assert not SpeculativeConfig(num_speculative_tokens=2).defers_mtp_kv
    with pytest.raises(ValueError, match="adaptive_defer_mtp_kv must be true or false, got 'no'"):
        SpeculativeConfig(num_speculative_tokens=2, adaptive=True, adaptive_defer_mtp_kv="no")
    from mtpspec.engine.arg_utils import parse_speculative_config
    with pytest.raises(ValueError, match="adaptive_defer_mtp_kv must be true or false, got 1"):
        parse_speculative_config({"adaptive": True, "adaptive_defer_mtp_kv": 1})


def test_cost_table_times_the_hidden_state_write_for_k0_and_no_kv_only_units_are_captured(tiny, monkeypatch) -> None:
    """With deferral, a k = 0 step's MTP work is the hidden-state write: inside the verify units of a
    graphed runner (its draft cost 0), else timed on its own (not the KV-only units, which are not
    captured); without deferral, the KV-only units."""
    from mtpspec.engine.forward import GraphedForward
    from mtpspec.spec_decode import adaptive
    path, cfg, _ = tiny
    seen = []
    monkeypatch.setattr(adaptive, "_hidden_write_ms", lambda runner, bp, repeats: seen.append(bp) or 0.125)
    for defer, mode in ((True, "static"), (True, "off"), (False, "static")):
        seen.clear()
        spec = {"num_speculative_tokens": 2, "adaptive": True, "adaptive_defer_mtp_kv": defer}
        with LLM(path, speculative_config=spec, max_model_len=48, block_size=4, num_kv_blocks=64, max_num_seqs=2,
                 graph_mode=mode, device="cpu") as llm:
            runner = llm.llm_engine.executor.runner
            costs = llm.llm_engine.spec_policy.costs
            assert isinstance(runner.fwd, GraphedForward) == (mode == "static")
            if mode == "static":
                assert runner.fwd.kv_only == (not defer)
                assert (runner.fwd.hidden_sink is runner.hidden_cache) and (runner.hidden_cache is not None) == defer
            if defer and mode == "static":
                assert costs.draft_ms[0] == {1: 0.0, 2: 0.0} and seen == []
            elif defer:
                assert costs.draft_ms[0] == {1: 0.125, 2: 0.125} and seen == [1, 2]
            else:
                assert all(t != 0.125 and t > 0 for t in costs.draft_ms[0].values()) and seen == []


@pytest.mark.parametrize("batch,padded", [(1, 1), (3, 4), (4, 4)])
def test_a_graph_unit_s_padded_write_equals_the_write_of_its_real_rows(batch, padded) -> None:
    """``write_padded`` (the verify units' hidden-state write, CUDA-graph safe): padding rows (slot -1,
    values unlike row 0's) leave the cache as :meth:`write` of the real rows alone leaves it."""
    g = torch.Generator().manual_seed(batch)
    hidden = torch.randn(padded * 2, 8, generator=g)
    slots = torch.tensor([5, 9, 2, 14, 7, 3, 11, 0][:batch * 2] + [-1] * (padded - batch) * 2)
    want, got = MTPHiddenStateCache(8, torch.float32), MTPHiddenStateCache(8, torch.float32)
    for c in (want, got):
        c.kv_cache = torch.full((4, 4, 8), 7.5)
    want.write(hidden[:batch * 2], slots[:batch * 2])
    got.write_padded(hidden, slots)
    assert torch.equal(got.kv_cache, want.kv_cache)


def test_bench_arms_adaptive_eagerkv_arm_is_adaptive_without_deferral() -> None:
    """(and ``adaptive_m0`` is adaptive without the switch margin)"""
    from mtpspec.entrypoints.bench_arms import DEFAULT_ARMS
    from mtpspec.entrypoints.serve import check_serve_args
    ref = check_serve_args(DEFAULT_ARMS["adaptive"])["speculative_config"]
    for arm, key, value in (("adaptive_eagerkv", "adaptive_defer_mtp_kv", False),
                            ("adaptive_m0", "adaptive_switch_margin", 0)):
        spec = check_serve_args(DEFAULT_ARMS[arm])["speculative_config"]
        got = spec.pop(key)
        assert got == value and type(got) is type(value) and key not in ref, arm
        assert spec == ref, arm
    from mtpspec.entrypoints.serve import engine_info  # /v1/models tells the two apart
    kw = dict(model="m", tensor_parallel_size=1, fuse_allreduce_rmsnorm=True, sequence_parallel=False,
              allreduce_backend="nccl", max_num_seqs=4, enable_chunked_prefill=True, max_num_batched_tokens=None,
              long_prefill_token_threshold=0, enable_prefix_caching=True, kv_cache_dtype="auto", dtype=None, seed=0)
    for arm, want in (("adaptive", True), ("adaptive_eagerkv", False), ("k3", False)):
        spec = check_serve_args(DEFAULT_ARMS[arm])["speculative_config"]
        assert engine_info(None, {**kw, "speculative_config": spec}, None)["adaptive_defer_mtp_kv"] is want, arm


def test_catch_up_tokens_reach_the_server_metrics() -> None:
    """``/metrics``: ``mtpspec:spec_decode_num_mtp_catch_up_tokens`` follows the engine's counter."""
    from types import SimpleNamespace

    from mtpspec.engine.async_llm import EngineStats
    from mtpspec.entrypoints.server_metrics import ServerMetrics
    from mtpspec.spec_decode.metrics import EngineMetrics, SpecDecodingStats
    sm = ServerMetrics(3, {"model": "tiny"})
    m = EngineMetrics(spec=SpecDecodingStats(3))
    for total in (7, 19):
        m.spec.num_mtp_catch_up_tokens = total
        sm.on_step(SimpleNamespace(metrics=m), [])
    text = sm.render(EngineStats()).decode()
    assert 'mtpspec:spec_decode_num_mtp_catch_up_tokens_total{model_name="tiny"} 19.0' in text


def test_an_engine_held_at_k0_hits_whole_cached_prompts(tiny) -> None:
    """Every step at k = 0 (deferred entries: no block of the first request gets an MTP entry): the
    second request's hit covers the shared prompt's full blocks, not only the first (H100,
    2026-12-05: an adaptive engine held at k = 0 prefilled in 304 steps where plain decoding hit);
    tokens equal plain decoding's."""
    path, cfg, table = tiny
    head = mixed_prompts(2, cfg.vocab_size, seed=9)[1][:13]  # three full blocks of 4 + 1
    prompts = [head + [7], head + [8, 9], head[:12]]  # the third ends at a block boundary: its last block copied
    hits = []
    want = _run(path, table, [0], True, prompts, k=0, max_num_seqs=1)[0]
    toks, _, rows, metrics = _run(path, table, [0] * 100, True, prompts, hits=hits, max_num_seqs=1)
    assert toks == want and rows == [0]  # nothing drafted, nothing caught up
    assert hits == [(0, 0), (12, 0), (11, 0)], hits  # the copy of a block without entries: its last row recomputed

"""Automatic prefix caching (issue 17): outputs, drafts and KV entries with caching == without.

Two levels:

* A simulated engine (scheduler + block manager, no model): each KV slot holds what the real
  caches would hold, the target entry of position ``p`` as a key of ``tokens[:p + 1]`` and the
  MTP entry as a key of ``tokens[:p + 2]`` (the MTP layer reads the token after ``p``), with
  rejected drafts and draft steps writing their own (wrong) keys. Every step checks that each
  sequence's context (all positions below its first row) holds exactly its own keys before
  anything is written, and that no step writes into a cached block. Randomised workloads with
  shared prefixes, tiny block pools (eviction, preemption), chunking and k 0 / 1 / 3.
* Tiny real models (fp32): tokens (greedy and seeded), the MTP drafts, and the final KV entries
  of every cache of every layer (target, MTP, DSA indexer keys) of each request equal those of
  an engine without caching, on GLM-4.5 (GQA), DeepSeek-V3.2 (sparse MLA + indexer) and
  DeepSeek-V3 (dense MLA), at tp 1 and tp 2; prefixes that end mid-block and on a block
  boundary, prompts that differ right after a block boundary (the MTP entry of the block's last
  position needs the other next token: a private copy, one position recomputed), and a prefix
  evicted between requests. A deliberately wrong reuse (the block's key without the next token)
  is detected by the same comparison.
"""

from __future__ import annotations

import random
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from test_engine_fixtures import OracleDrafts, make_model, token_prompts
from test_scheduler import EOS, draft, greedy_chain, target_next

from mtpspec import LLM, SamplingParams
from mtpspec.engine.block_manager import BlockManager
from mtpspec.engine.config import SchedulerConfig
from mtpspec.engine.parallel_sampling import ParentRequest
from mtpspec.engine.scheduler import Scheduler
from mtpspec.engine.sequence import Sequence


# ------------------------------------------------------------------------------------------ simulated
class SimKV:
    """Slot -> key of what the target / MTP layer wrote there."""

    def __init__(self, num_blocks: int, block_size: int):
        self.bs = block_size
        self.target: List[object] = [None] * (num_blocks * block_size)
        self.mtp: List[object] = [None] * (num_blocks * block_size)

    def copy(self, src: int, dst: int) -> None:
        for o in range(self.bs):
            self.target[dst * self.bs + o] = self.target[src * self.bs + o]
            self.mtp[dst * self.bs + o] = self.mtp[src * self.bs + o]


def _slot(seq: Sequence, p: int, bs: int) -> int:
    assert p // bs < len(seq.block_table), f"position {p} outside {seq!r}'s table"
    return seq.block_table[p // bs] * bs + p % bs


def run_sim(prompts: List[List[int]], k: int, num_blocks: int, waves: int = 2, block_size: int = 4,
            max_num_seqs: int = 4, threshold: int = 0, chunked: bool = True, seed: int = 0,
            max_tokens: int = 6, caching: bool = True, n: int = 1) -> Dict[str, int]:
    """Serve ``prompts`` ``waves`` times (each wave after the previous finished, in shuffled
    order) through the scheduler with a simulated model; checks every step (module docstring),
    and that no step writes into a block another running sequence references. ``n > 1``: each
    prompt is a request of ``n`` children (parallel sampling: siblings fork child 0's blocks)."""
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=64, num_speculative_tokens=k,
                          enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold)
    bm = BlockManager(num_blocks, block_size, watermark=0.0, enable_caching=caching, key_next_token=k > 0)
    sched = Scheduler(cfg, bm, [EOS])
    kv = SimKV(num_blocks, block_size)
    rng = random.Random(seed)
    stats = dict(hits=0, queries=0, copies=0, preemptions=0, steps=0, cached_reads=0, shared_reads=0)
    bs = block_size
    for wave in range(waves):
        order = list(range(len(prompts)))
        rng.shuffle(order)
        sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, n=n)  # the model is greedy
        seqs = []
        for j, i in enumerate(order):
            parent = ParentRequest(f"{wave}-{i}", sp, float(wave * 100 + j)) if n > 1 else None
            for c in range(n):
                s = Sequence(f"{c}_{wave}-{i}", None, prompts[i], sp if parent is None else parent.child_params(c), 0,
                             float(wave * 100 + j))
                if parent is not None:
                    s.parent = parent
                    parent.children.append(s)
                seqs.append((i, s))
        for _, s in seqs:
            sched.add(s)
        while sched.has_unfinished():
            out = sched.schedule()
            assert not out.is_empty, "scheduler stalled"
            stats["steps"] += 1
            stats["preemptions"] += len(out.preempted)
            stats["hits"] += out.prefix_cache_hits
            stats["queries"] += out.prefix_cache_queries
            stats["copies"] += len(out.block_copies)
            # reference counts = the running tables' references + pinned copy sources
            refs = [0] * num_blocks
            for s in sched.running:
                for b in s.block_table:
                    refs[b] += 1
            table_refs = list(refs)  # a pinned copy source may be written after the copy ran
            for b in bm._pinned:
                refs[b] += 1
            assert refs == bm.pool.ref_cnt
            assert bm.num_free_blocks == sum(1 for r in refs if r == 0)
            for src, dst in out.block_copies:  # before the forward
                kv.copy(src, dst)
            new_tokens, drafts, writes = [], [], []
            for sch in out.scheduled:
                s, start = sch.seq, sch.start_position
                ctx = s.all_token_ids
                assert start == s.num_computed_tokens
                for p in range(start):  # the context this sequence reads
                    assert kv.target[_slot(s, p, bs)] == tuple(ctx[:p + 1]), f"target entry {p} of {s!r}"
                    if k:
                        assert kv.mtp[_slot(s, p, bs)] == tuple(ctx[:p + 2]), f"MTP entry {p} of {s!r}"
                shared = [b for b in s.block_table[:start // bs] if bm.pool.block_key[b] is not None]
                stats["cached_reads"] += len(shared)
                stats["shared_reads"] += sum(table_refs[b] > 1 for b in s.block_table[:start // bs])
                if sch.is_prefill:
                    end = start + len(sch.input_token_ids)
                    emitted = [] if sch.is_partial_prefill else [target_next(ctx)]
                    full = ctx + emitted
                    rows = [(p, tuple(full[:p + 1]), tuple(full[:p + 2])) for p in range(start, end)]
                    last = end - 1
                else:
                    toks = ctx + s.draft_token_ids  # verify rows: last token + drafts
                    emitted, c = [], list(ctx)
                    for d in s.draft_token_ids:
                        t = target_next(c)
                        emitted.append(t)
                        if t != d:
                            break
                        c.append(t)
                    else:
                        emitted.append(target_next(c))
                    a = len(emitted) - 1
                    # first pass: row j reads the token after it, the new token at row a
                    nxt = toks[start + 1:] + [0]
                    nxt[a] = emitted[-1]
                    rows = [(start + j, tuple(toks[:start + j + 1]), tuple(toks[:start + j + 1]) + (nxt[j],))
                            for j in range(k + 1)]
                    last = start + a
                for p, t_key, m_key in rows:
                    writes.append((s, p, t_key, m_key if k else None))
                for j in range(1, k):  # draft steps write junk after the last accepted row
                    writes.append((s, last + j, ("draft", j), ("draft", j)))
                new_tokens.append(emitted)
                drafts.append(draft(ctx + emitted, k, rng))
            for s, p, t_key, m_key in writes:
                slot = _slot(s, p, bs)
                assert bm.pool.block_key[slot // bs] is None, f"{s!r} writes position {p} into a cached block"
                assert table_refs[slot // bs] == 1, f"{s!r} writes position {p} into a shared block"
                kv.target[slot] = t_key
                if m_key is not None:
                    kv.mtp[slot] = m_key
            sched.update_from_output(out, new_tokens, drafts if k else None)
            assert stats["steps"] < 5000
        for i, s in seqs:
            assert s.output_token_ids == greedy_chain(prompts[i], max_tokens), s
            assert s.metrics.num_cached_tokens is not None
    bm.release_pinned()
    assert bm.num_free_blocks == num_blocks
    stats["evictions"] = bm.pool.num_evictions
    return stats


def shared_prefix_prompts(seed: int, n: int = 8, vocab: int = 40) -> List[List[int]]:
    """Prompts sharing prefixes of lengths that end mid-block and on block boundaries (block 4),
    some differing right after a boundary, some a prefix of another, some repeated."""
    rng = random.Random(seed)
    base = [rng.randrange(1, vocab) for _ in range(24)]
    out = []
    for i in range(n):
        cut = rng.choice([3, 4, 8, 9, 12, 13, 16, 20])
        tail = [rng.randrange(1, vocab) for _ in range(rng.choice([0, 1, 3, 4, 6]))]
        out.append(base[:cut] + tail if cut + len(tail) > 0 else base[:4])
    out.append(list(out[0]))
    return out


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("num_blocks,threshold", [(200, 0), (200, 3), (24, 5)])
def test_simulated_cache_holds_exactly_each_sequences_context(k, num_blocks, threshold):
    copies = 0
    for seed in range(4):
        prompts = shared_prefix_prompts(seed)
        stats = run_sim(prompts, k, num_blocks, threshold=threshold, seed=seed)
        assert 0 < stats["hits"] <= stats["queries"] and stats["cached_reads"] > 0
        copies += stats["copies"]
    assert copies > 0  # next-token mismatches / prompts ending on a block boundary


@pytest.mark.parametrize("chunked,threshold", [(False, 0), (True, 3)])
def test_simulated_eviction_and_preemption(chunked, threshold):
    """16 blocks for four running requests of up to 10 blocks: cached blocks are evicted between
    and within waves, decodes preempt sequences that hold shared blocks, and the recomputes hit
    their own cached blocks again."""
    prompts = shared_prefix_prompts(7, n=10)
    for seed in range(3):
        stats = run_sim(prompts, 3, 16, waves=3, chunked=chunked, threshold=threshold, seed=seed)
        assert stats["hits"] > 0 and stats["preemptions"] > 0 and stats["evictions"] > 0


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("k,num_blocks,threshold", [(0, 200, 0), (3, 200, 0), (1, 200, 3), (3, 16, 0), (1, 16, 5)])
def test_simulated_parallel_sampling_shares_the_prompt(k, num_blocks, threshold, caching):
    """n = 3 children per prompt: the siblings read child 0's prompt blocks (caching on or off),
    with chunking, and with 16 blocks preemptions (and, caching on, evictions); every context
    stays exact and no sequence writes into a block it shares."""
    for seed in range(3):
        stats = run_sim(shared_prefix_prompts(seed, n=5), k, num_blocks, threshold=threshold, seed=seed,
                        caching=caching, n=3, max_tokens=10)
        assert stats["shared_reads"] > 0 and (stats["preemptions"] > 0) == (num_blocks == 16)


def test_simulated_check_catches_a_wrong_reuse(monkeypatch):
    """Control: keying blocks without the next token (k > 0) reuses a block whose last MTP entry
    was computed with another token; the simulated reads see it."""
    orig = BlockManager.__init__

    def wrong(self, *a, **kw):
        kw["key_next_token"] = False
        orig(self, *a, **kw)
    monkeypatch.setattr(BlockManager, "__init__", wrong)
    with pytest.raises(AssertionError, match="MTP entry"):
        for seed in range(4):
            run_sim(shared_prefix_prompts(seed), 3, 200, seed=seed)


# ------------------------------------------------------------------------------------------ tiny models
KW = dict(max_model_len=64, block_size=4, seed=0, max_num_seqs=4, num_kv_blocks=256)
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def seeded(n: int) -> List[SamplingParams]:
    return [SamplingParams(temperature=0.9, seed=50 + i, max_tokens=MAX_TOKENS, ignore_eos=True) for i in range(n)]


def engine_prompts(vocab: int, seed: int) -> List[List[List[int]]]:
    """Waves of prompts (block size 4) over a shared 23-token base: the first wave writes the
    cache, the second reuses it: prefixes ending mid-block (22, 13), on a block boundary (20)
    with different tokens right after it (the MTP entry at 19 needs another next token), a
    prompt that is exactly 20 / 8 base tokens (ends on a boundary: its last position is
    recomputed), a repeat, and an unrelated prompt."""
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab) for _ in range(23)]
    tail = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    first = [base[:22] + tail(5)]
    second = [base[:22] + tail(3), base[:20] + tail(4), base[:20] + tail(1), list(base[:20]), base[:13] + tail(2),
              list(first[0]), tail(9), list(base[:8])]
    return [first, second]


class Run:
    """Serve ``waves`` one after the other in one engine; records tokens, MTP proposals, the
    final KV entries of each finished request (tp 1) and what the cache did."""

    def __init__(self, path: str, waves: List[List[List[int]]], params, k: int = 0, caching: bool = True,
                 oracle: Optional[Dict] = None, spec_extra: Optional[dict] = None, snapshot: bool = True, **kw):
        spec = {"num_speculative_tokens": k, **(spec_extra or {})} if k else None
        self.kv: Dict[Tuple[int, ...], List[torch.Tensor]] = {}
        self.proposals: List[Tuple[Tuple[int, ...], Tuple[int, ...]]] = []
        self.copies = 0
        with LLM(path, speculative_config=spec, enable_prefix_caching=caching, **{**KW, **kw}) as llm:
            eng = llm.llm_engine
            if k and oracle is not None:
                hook = OracleDrafts(oracle, eng.vocab_size, corrupt=0.3)

                def record(seq, proposed):
                    self.proposals.append((tuple(seq.all_token_ids), tuple(proposed)))
                    return hook(seq, proposed)
                eng.draft_hook = record
            bm = eng.scheduler.block_manager
            if snapshot and llm.engine_config.parallel_config.tensor_parallel_size == 1:
                self._snapshot_on_free(bm, llm.executor.runner)
            schedule = eng.scheduler.schedule

            def watched(**kw):
                out = schedule(**kw)
                self.copies += len(out.block_copies)
                return out
            eng.scheduler.schedule = watched
            self.outputs = []
            for i, wave in enumerate(waves):
                ps = params[i] if isinstance(params, list) and isinstance(params[0], list) else params
                self.outputs += llm.generate(token_prompts(wave), ps, use_tqdm=False)
            self.tokens = [o.outputs[0].token_ids for o in self.outputs]
            self.cached = [o.num_cached_tokens for o in self.outputs]
            self.metrics = llm.get_metrics()
            self.evictions = bm.pool.num_evictions
            self.graph_steps = getattr(getattr(llm.executor, "runner", None), "fwd", None)
            self.graph_steps = getattr(self.graph_steps, "num_graph_steps", 0)
        self.proposals.sort()

    def _snapshot_on_free(self, bm: BlockManager, runner) -> None:
        free, bs = bm.free, bm.block_size

        def snapshot_then_free(seq):
            if seq.finish_reason is not None and seq.finish_reason != "abort":
                n = min(seq.num_computed_tokens, seq.num_tokens - 1)  # final entries
                pos = torch.arange(n)
                blocks = torch.tensor(seq.block_table)[pos // bs]
                entries = []
                for layer in runner.layers:
                    bd = layer.get_attn_backend().block_dim
                    cache = layer.kv_cache.movedim((bd, bd + 1), (0, 1))
                    entries.append(cache[blocks, pos % bs].clone())
                self.kv.setdefault(tuple(seq.prompt_token_ids), entries)
            free(seq)
        bm.free = snapshot_then_free


def assert_same_kv(a: Run, b: Run, atol: float = 1e-4) -> None:
    """Every request's final entries in every cache of every layer agree (fp32, batch shapes differ)."""
    assert a.kv.keys() == b.kv.keys() and a.kv
    for prompt, layers in a.kv.items():
        for i, (x, y) in enumerate(zip(layers, b.kv[prompt])):
            assert x.shape == y.shape
            err = (x.float() - y.float()).abs().max().item()
            assert err <= atol, f"layer {i}: entries differ by {err} for a {len(prompt)}-token prompt"


def oracle_of(waves, tokens) -> Dict[Tuple[int, ...], List[int]]:
    prompts = [p for w in waves for p in w]
    return {tuple(p): t for p, t in zip(prompts, tokens)}


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """GLM-4.5 tiny (GQA): (path, waves, greedy reference without caching, oracle continuations)."""
    path = str(tmp_path_factory.mktemp("tiny_prefix"))
    _, cfg = make_model(path, seed=3)
    waves = engine_prompts(cfg.vocab_size, seed=1)
    ref = Run(path, waves, GREEDY, caching=False, snapshot=False)
    long = Run(path, waves, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS + 8, ignore_eos=True),
               caching=False, snapshot=False)
    return path, waves, ref.tokens, oracle_of(waves, long.tokens)


@pytest.fixture(scope="module")
def glm_k3_nocache(glm):
    path, waves, ref, oracle = glm
    run = Run(path, waves, GREEDY, k=3, caching=False, oracle=oracle)
    assert run.tokens == ref and run.copies == 0 and run.metrics["prefix_cache_hits"] == 0
    return run


def _check_hits(run: Run, waves) -> None:
    m = run.metrics
    n = [len(p) for w in waves for p in w]
    assert m["prefix_cache_queries"] == sum(n)
    assert m["prefix_cache_hits"] == sum(run.cached) > 0
    assert run.cached[0] == 0  # the first request finds an empty cache
    assert run.copies > 0  # a next-token mismatch or a prompt ending on a block boundary
    assert all(c <= t - 1 for c, t in zip(run.cached, n))  # the last token is always computed


def test_greedy_k3_tokens_drafts_and_kv_equal_without_caching(glm, glm_k3_nocache):
    path, waves, ref, oracle = glm
    run = Run(path, waves, GREEDY, k=3, oracle=oracle)
    assert run.tokens == ref
    _check_hits(run, waves)
    # second wave: 22-token prefix (5 blocks + 2) -> 20 cached; 20 base tokens + 4 -> 19 (block
    # 4's stored next token is base[20], this prompt's differs: copy + recompute position 19);
    # exactly 20 base tokens -> 19; 13 base tokens + 2 -> 12; the repeat -> 24 (6 of its 7
    # blocks; 27 tokens); the unrelated prompt -> 0; exactly 8 base tokens -> 7
    assert run.cached[1:] == [20, 19, 19, 19, 12, 24, 0, 7]
    assert run.proposals == glm_k3_nocache.proposals  # MTP drafts read the same MTP cache
    assert sum(1 for h in run.metrics["accepted_length_histogram"] if h) >= 3
    assert_same_kv(run, glm_k3_nocache)


@pytest.mark.parametrize("k", [0, 3])
def test_seeded_sampling_equal_without_caching(glm, k):
    path, waves, _, oracle = glm
    params = [seeded(len(w)) for w in waves]
    want = Run(path, waves, params, k=k, caching=False, snapshot=False)
    run = Run(path, waves, params, k=k, snapshot=False)
    assert run.tokens == want.tokens and len({tuple(t) for t in run.tokens}) > 1
    _check_hits(run, waves)


def test_greedy_k0_tokens_and_kv_equal_without_caching(glm):
    """Plain decoding: blocks match by hash alone (no MTP entry depends on the next token), so
    the 20-token prefix is reused whole; a prompt ending on a boundary still copies."""
    path, waves, ref, _ = glm
    run, want = Run(path, waves, GREEDY), Run(path, waves, GREEDY, caching=False)
    assert run.tokens == ref == want.tokens
    _check_hits(run, waves)
    assert run.cached[1:] == [20, 20, 20, 19, 12, 24, 0, 7]
    assert_same_kv(run, want)


def test_wrong_reuse_is_detected(glm, glm_k3_nocache, monkeypatch):
    """Control: keying blocks without the next token at k = 3 reuses block 4 of the 23-token
    base for prompts that continue differently after position 19; the MTP entry there was
    computed with the first prompt's token, and the KV comparison sees it."""
    path, waves, _, oracle = glm
    orig = BlockManager.__init__
    monkeypatch.setattr(BlockManager, "__init__", lambda self, *a, **kw: orig(self, *a, **{**kw, "key_next_token": False}))
    run = Run(path, waves, GREEDY, k=3, oracle=oracle)
    assert run.cached[2] == 20  # reused as is
    with pytest.raises(AssertionError, match="entries differ"):
        assert_same_kv(run, glm_k3_nocache)


def test_chunked_and_graph_path_and_prompt_logprobs(glm):
    """3-token chunks after a cached prefix (the copy's recomputed row is a chunk's first row),
    the pure-decode steps through the CUDA-graph code path (``graph_mode="static"``), and a
    request with prompt logprobs, which skips the lookup (its rows must be computed)."""
    path, waves, ref, oracle = glm
    run = Run(path, waves, GREEDY, k=3, oracle=oracle, long_prefill_token_threshold=3, graph_mode="static")
    assert run.tokens == ref and run.graph_steps > 0
    _check_hits(run, waves)
    sp = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2, ignore_eos=True)
    outs = []
    for caching in (True, False):
        with LLM(path, enable_prefix_caching=caching, **KW) as llm:
            llm.generate(token_prompts(waves[0]), GREEDY, use_tqdm=False)
            outs.append(llm.generate(token_prompts(waves[1][:1]), sp, use_tqdm=False)[0])
    assert outs[0].num_cached_tokens == 0 and outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    for a, b in zip(outs[0].prompt_logprobs[1:], outs[1].prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


@pytest.mark.parametrize("num_fillers", [2, 4])
def test_prefix_evicted_between_requests(glm, num_fillers):
    """24 blocks: unrelated 30-token prompts served between two waves that share a 22-token
    prefix evict its cached blocks, tail first: two leave its head blocks (a shorter hit), four
    evict it all (and a decode preempts a filler, recomputed through the cache). Tokens equal
    an uncached engine's."""
    path, waves, ref, _ = glm
    rng = random.Random(5)
    filler = [[rng.randrange(3, 200) for _ in range(30)] for _ in range(num_fillers)]
    seq = [waves[0], filler, waves[1][:2]]
    want = Run(path, seq, GREEDY, k=3, caching=False, snapshot=False, num_kv_blocks=24)
    run = Run(path, seq, GREEDY, k=3, snapshot=False, num_kv_blocks=24)
    assert run.tokens == want.tokens and run.tokens[0] == ref[0]
    assert run.evictions > 0
    if num_fillers == 2:
        assert 0 < run.cached[-2] < 20 and run.cached[-2] % 4 == 0  # head blocks left
    else:
        assert run.cached[-2:] == [0, 0] and run.metrics["num_preemptions"] > 0


# ------------------------------------------------------------------------------------------ MLA / DSA
def _mla(tmp_path_factory, family: str, num_mtp_layers: int, seed: int):
    path = str(tmp_path_factory.mktemp(f"{family}_prefix"))
    _, cfg = make_model(path, seed=seed, num_mtp_layers=num_mtp_layers, family=family)
    waves = engine_prompts(cfg.vocab_size, seed=seed)
    long = Run(path, waves, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS + 8, ignore_eos=True),
               caching=False, snapshot=False)
    return path, waves, oracle_of(waves, long.tokens)


@pytest.fixture(scope="module")
def dsv32(tmp_path_factory):
    """DeepSeek-V3.2 tiny: sparse MLA + lightning indexer (index_topk 6), two MTP layers."""
    return _mla(tmp_path_factory, "deepseek_v32", 2, 11)


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    """GLM-5 tiny (glm_moe_dsa): DSA with "shared" indexer layers, one MTP layer."""
    return _mla(tmp_path_factory, "glm_moe_dsa", 1, 17)


@pytest.mark.parametrize("family,share", [("deepseek_v32", False), ("deepseek_v32", True), ("glm_moe_dsa", False)])
def test_dsa_tokens_drafts_and_kv_equal_without_caching(request, family, share):
    """The latent cache, the indexer key caches (target and MTP layers) and the MTP layers'
    caches after a next-token-mismatch hit equal an uncached engine's; context above
    ``index_topk``; with MTP index sharing too; GLM-5's shared indexer layers."""
    path, waves, oracle = request.getfixturevalue("dsv32" if family == "deepseek_v32" else "glm5")
    extra = {"index_share_for_mtp_iteration": share}
    want = Run(path, waves, GREEDY, k=3, caching=False, oracle=oracle, spec_extra=extra)
    run = Run(path, waves, GREEDY, k=3, oracle=oracle, spec_extra=extra)
    assert run.tokens == want.tokens and run.proposals == want.proposals
    _check_hits(run, waves)
    assert run.cached[2] == 19
    assert_same_kv(run, want)


def test_dense_mla_tokens_and_kv_equal_without_caching(tmp_path_factory):
    path, waves, oracle = _mla(tmp_path_factory, "deepseek_v3", 1, 13)
    want = Run(path, waves, GREEDY, k=3, caching=False, oracle=oracle)
    run = Run(path, waves, GREEDY, k=3, oracle=oracle)
    assert run.tokens == want.tokens and run.proposals == want.proposals
    _check_hits(run, waves)
    assert_same_kv(run, want)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v32"])
def test_triton_kernels_read_shared_and_copied_blocks(glm, dsv32, family, interp):
    """Through the Triton kernels (interpreter): two requests in one step share a cached block and
    each recomputes the last position of its own copy of the second (their token after it
    differs from the cached one); paged GQA (GLM-4.5) or the indexer + sparse MLA (DeepSeek-V3.2)
    read them in the prefill, verify and draft rows."""
    path, oracle = (glm[0], glm[3]) if family == "glm4_moe" else (dsv32[0], dsv32[2])
    first = list(next(iter(oracle)))[:9]  # above index_topk (6)
    waves = [[first], [first[:8] + [first[8] % 50 + 3], first[:8] + [first[8] % 50 + 4]]]
    oracle = {**oracle, **{tuple(p): [3] * 8 for w in waves for p in w}}
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    want = Run(path, waves, sp, k=3, caching=False, oracle=oracle)
    run = Run(path, waves, sp, k=3, oracle=oracle)
    assert run.cached == [0, 7, 7] and run.copies == 2
    assert run.tokens == want.tokens and run.proposals == want.proposals
    assert_same_kv(run, want)


# ------------------------------------------------------------------------------------------ tp 2
_STEPS: List[tuple] = []


def _record_steps(runner) -> bool:
    inner = runner.execute_model

    def wrapped(step):
        out = inner(step)
        _STEPS.append((len(step.block_copies), out.new_token_ids, out.draft_token_ids))
        return out
    runner.execute_model = wrapped
    return True


def _fetch_steps(runner) -> List[tuple]:
    return list(_STEPS)


@pytest.mark.parametrize("k", [0, 3])
def test_tp2_equal_without_caching(glm, k):
    """tp 2 (gloo): the block copies reach both ranks through the step input; both ranks compute
    the same tokens and drafts; the tokens are the tp-1 uncached engine's."""
    path, waves, ref, oracle = glm
    spec = {"num_speculative_tokens": k, "use_local_argmax_reduction": True} if k else None
    with LLM(path, tensor_parallel_size=2, speculative_config=spec, enable_prefix_caching=True, **KW) as llm:
        if k:
            llm.llm_engine.draft_hook = OracleDrafts(oracle, llm.llm_engine.vocab_size, corrupt=0.3)
        assert llm.collective_rpc(_record_steps) == [True, True]
        outs = [o for w in waves for o in llm.generate(token_prompts(w), GREEDY, use_tqdm=False)]
        steps = llm.collective_rpc(_fetch_steps)
        hits = llm.get_metrics()["prefix_cache_hits"]
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert steps[0] == steps[1] and sum(c for c, _, _ in steps[0]) > 0 and hits > 0

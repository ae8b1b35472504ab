"""Chunked prefill (issue 17): outputs with chunking == without, on the GLM-4.5 and DeepSeek-V3.2 tiny models.

Chunk sizes are set exactly with ``long_prefill_token_threshold`` (1, 7, 64 and 8 = two 4-token
blocks) or left to the budget the running decodes leave (``max_num_batched_tokens`` a few tokens
above ``max_num_seqs * (1 + k)``, so the chunk size changes from step to step). Prompts of up to
70 tokens, eight requests with ``max_num_seqs`` 4, so chunks share steps with decodes and with
other prompts' chunks.

What is compared:

* tokens: greedy and seeded sampling, k 0 and 3, against the unchunked engine (greedy: plain
  decoding, which ``test_engine_lossless`` ties to ``transformers``);
* the MTP drafts (k 3): every draft the proposer makes with chunking equals the one it makes
  without, which only holds if the MTP first pass of every chunk wrote the MTP layer's KV cache
  exactly as a whole prefill does (each chunk's last row takes the next prompt token);
* verification after chunking: drafts come from an oracle (the reference continuation with 30%
  corrupted) so every accepted length occurs and the verify rows read a context written by
  several chunks (the known-faults list, item 11: MLA + speculative decoding wrong only
  with chunked prefill), on GQA, sparse MLA + indexer (DeepSeek-V3.2) and dense MLA (DeepSeek-V3),
  also through the Triton kernels (interpreter);
* preemption of a partially prefilled request (tiny ``num_kv_blocks``), the CUDA-graph code path
  (``graph_mode="static"``) for the pure-decode steps between chunked ones, a long prompt chunked
  while running requests keep decoding, and ``enable_chunked_prefill=False`` (today's behaviour).
"""

from __future__ import annotations

import random
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from test_engine_fixtures import OracleDrafts, make_model, token_prompts

from mtpspec import LLM, SamplingParams
from mtpspec.engine.scheduler import Scheduler

MAX_TOKENS = 10
LENS = (1, 70, 2, 9, 33, 4, 17, 65)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True) for i in range(8)]
KW = dict(max_model_len=96, block_size=4, seed=0, max_num_seqs=4)


def make_prompts(vocab: int, seed: int, lens=LENS) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def spec(k: int, **extra) -> Optional[dict]:
    return {"num_speculative_tokens": k, **extra} if k else None


class Run:
    """One engine run: tokens per prompt, proposals seen by the draft hook, partial-prefill stats."""

    def __init__(self, path: str, prompts, params, k: int = 0, oracle: Optional[Dict] = None,
                 spec_extra: Optional[dict] = None, **kw):
        self.proposals: List[Tuple[Tuple[int, ...], Tuple[int, ...]]] = []
        self.partial_chunks = 0
        self.partial_preemptions = 0
        opts = {**KW, "num_kv_blocks": 512, **kw}
        with LLM(path, speculative_config=spec(k, **(spec_extra or {})), **opts) as llm:
            eng = llm.llm_engine
            if k and oracle is not None:
                hook = OracleDrafts(oracle, eng.vocab_size, corrupt=0.3)

                def record(seq, proposed):
                    self.proposals.append((tuple(seq.all_token_ids), tuple(proposed)))
                    return hook(seq, proposed)
                eng.draft_hook = record
            self._watch(eng.scheduler)
            outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
            self.tokens = [o.outputs[0].token_ids for o in outs]
            self.metrics = llm.get_metrics()
            self.runner = llm.executor.runner
            self.config = llm.engine_config
        self.proposals.sort()

    def _watch(self, sched: Scheduler) -> None:
        schedule, preempt = sched.schedule, sched._preempt

        def watched_schedule(**kw):
            out = schedule(**kw)
            self.partial_chunks += out.num_partial_prefills
            return out

        def watched_preempt(seq):
            if seq.is_prefill and seq.num_computed_tokens > 0:
                self.partial_preemptions += 1
            preempt(seq)
        sched.schedule, sched._preempt = watched_schedule, watched_preempt


def oracle_of(prompts, tokens) -> Dict[Tuple[int, ...], List[int]]:
    return {tuple(p): t for p, t in zip(prompts, tokens)}


# ------------------------------------------------------------------------------------------ GLM-4.5
@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(path, prompts, plain greedy reference (unchunked), oracle continuation)."""
    path = str(tmp_path_factory.mktemp("tiny_chunked"))
    _, cfg = make_model(path, seed=3)
    prompts = make_prompts(cfg.vocab_size, seed=5)
    ref = Run(path, prompts, GREEDY, enable_chunked_prefill=False)
    assert ref.partial_chunks == 0
    long = Run(path, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS + 8, ignore_eos=True),
               enable_chunked_prefill=False)
    return path, prompts, ref.tokens, oracle_of(prompts, long.tokens)


@pytest.fixture(scope="module")
def glm_unchunked_k3(glm):
    path, prompts, ref, oracle = glm
    run = Run(path, prompts, GREEDY, k=3, oracle=oracle, enable_chunked_prefill=False)
    assert run.tokens == ref and run.proposals
    return run


@pytest.mark.parametrize("chunk", [1, 7, 64, 8])
@pytest.mark.parametrize("k", [0, 3])
def test_greedy_chunked_equals_unchunked(glm, glm_unchunked_k3, k, chunk):
    path, prompts, ref, oracle = glm
    run = Run(path, prompts, GREEDY, k=k, oracle=oracle, long_prefill_token_threshold=chunk)
    assert run.tokens == ref
    assert run.partial_chunks >= (2 if chunk == 64 else 10)  # the long prompts really were chunked
    if k:
        assert run.proposals == glm_unchunked_k3.proposals  # the MTP cache after chunks == after a prefill
        hist = run.metrics["accepted_length_histogram"]
        assert sum(1 for h in hist if h) >= 3, hist  # verify rows with several accepted lengths


@pytest.mark.parametrize("k", [0, 3])
def test_greedy_with_budget_left_by_decodes(glm, glm_unchunked_k3, k):
    """No threshold: each prompt's chunk is whatever the decodes leave of the budget (3 tokens when
    all four sequences decode), so chunk sizes vary and several prompts' chunks share steps."""
    path, prompts, ref, oracle = glm
    run = Run(path, prompts, GREEDY, k=k, oracle=oracle, max_num_batched_tokens=4 * (1 + k) + 3)
    assert run.tokens == ref and run.partial_chunks >= 10
    assert run.config.scheduler_config.max_num_batched_tokens < run.config.scheduler_config.max_model_len
    if k:
        assert run.proposals == glm_unchunked_k3.proposals


@pytest.fixture(scope="module")
def seeded_ref(glm):
    path, prompts, _, _ = glm
    return Run(path, prompts, SEEDED, enable_chunked_prefill=False).tokens


@pytest.mark.parametrize("k", [0, 3])
def test_seeded_chunked_equals_unchunked(glm, seeded_ref, k):
    """Seeded sampling: a request's draws depend only on its seed and the position decided, so
    chunking (and, through one-hot draft verification, k) cannot change its tokens."""
    path, prompts, _, _ = glm
    assert len({tuple(t) for t in seeded_ref}) == len(seeded_ref)
    oracle = oracle_of(prompts, seeded_ref)
    for chunk in (7, 64):
        run = Run(path, prompts, SEEDED, k=k, oracle=oracle, long_prefill_token_threshold=chunk)
        assert run.tokens == seeded_ref and run.partial_chunks > 0
        if k:
            assert 0 < run.metrics["num_accepted_tokens"] < run.metrics["num_draft_tokens"]


@pytest.mark.parametrize("params", ["greedy", "seeded"])
def test_preemption_mid_prompt(glm, seeded_ref, params):
    """30 blocks of 4 tokens: one 70-token prompt and its decode fit, eight requests do not, so
    decodes that grow preempt partially prefilled requests; they are recomputed from scratch."""
    path, prompts, ref, oracle = glm
    sp, want = (GREEDY, ref) if params == "greedy" else (SEEDED, seeded_ref)
    run = Run(path, prompts, sp, k=3, oracle=oracle_of(prompts, want) if params == "seeded" else oracle,
              long_prefill_token_threshold=7, num_kv_blocks=30)
    assert run.tokens == want
    assert run.partial_preemptions > 0 and run.metrics["num_preemptions"] >= run.partial_preemptions


def test_graph_code_path_between_chunked_steps(glm, glm_unchunked_k3):
    """Steps holding a chunk run eagerly; the pure-decode steps between them run through the padded
    static buffers of the CUDA-graph path (``graph_mode="static"``) and read a KV cache that chunks
    wrote."""
    path, prompts, ref, oracle = glm
    run = Run(path, prompts, GREEDY, k=3, oracle=oracle, long_prefill_token_threshold=7, graph_mode="static",
              max_num_seqs=8)
    assert run.tokens == ref and run.partial_chunks > 0
    assert run.metrics["num_eager_fallbacks"] == 0 and run.runner.fwd.num_graph_steps >= 3
    assert run.proposals == glm_unchunked_k3.proposals


def test_long_prompt_chunked_while_running_requests_decode(glm):
    """A 90-token prompt arrives while three requests decode: it is prefilled over eight steps
    (budget 4 * (1 + k) + 8 = 24 tokens: 12 decode rows, 12-token chunks), and in every one of them
    the three running requests get their decode rows and emit tokens (no whole-prompt stall)."""
    path, _, _, _ = glm
    prompts = make_prompts(200, seed=9, lens=(5, 6, 7, 90))
    k = 3
    with LLM(path, speculative_config=spec(k), max_model_len=128, block_size=4, num_kv_blocks=512, seed=0,
             max_num_seqs=4, max_num_batched_tokens=4 * (1 + k) + 8) as llm:
        eng = llm.llm_engine
        sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        for p in prompts[:3]:
            eng.add_request({"prompt_token_ids": p}, sp)
        eng.step()  # the three short prompts' prefills
        seqs = list(eng.scheduler.running)
        eng.add_request({"prompt_token_ids": prompts[3]}, SamplingParams(temperature=0.0, max_tokens=4,
                                                                         ignore_eos=True))
        steps = []
        schedule = eng.scheduler.schedule

        def watched(**kw):
            out = schedule(**kw)
            steps.append(out)
            return out
        eng.scheduler.schedule = watched
        while True:
            before = [len(s.output_token_ids) for s in seqs]
            eng.step()
            out = steps[-1]
            chunks = [s for s in out.scheduled if s.is_prefill]
            if not chunks:
                break
            assert [s.seq for s in out.scheduled if not s.is_prefill] == seqs
            assert all(len(s.output_token_ids) > b for s, b in zip(seqs, before))  # decodes progressed
            assert out.num_decode_tokens == 3 * (1 + k) and out.num_batched_tokens <= 4 * (1 + k) + 8
        chunks = [(s.start_position, len(s.input_token_ids), s.is_partial_prefill) for o in steps for s in o.scheduled
                  if s.is_prefill]
        assert chunks == [(12 * i, 12, True) for i in range(7)] + [(84, 6, False)]
        long_seq = steps[0].scheduled[-1].seq
        assert not long_seq.is_prefill and len(long_seq.output_token_ids) >= 1
        eng.scheduler.schedule = schedule
        while eng.has_unfinished_requests():
            eng.step()
    with LLM(path, max_model_len=128, block_size=4, num_kv_blocks=512, seed=0, enable_chunked_prefill=False) as llm:
        want = llm.generate(token_prompts(prompts[3:]), SamplingParams(temperature=0.0, max_tokens=4,
                                                                        ignore_eos=True), use_tqdm=False)
    assert long_seq.output_token_ids == want[0].outputs[0].token_ids


def test_chunking_off_is_todays_behaviour(glm):
    """``enable_chunked_prefill=False``: every prefill is one whole prompt, and the budget must hold
    ``max_model_len`` (a smaller one is refused, naming the flag); with chunking on it need not."""
    path, prompts, ref, _ = glm
    run = Run(path, prompts, GREEDY, k=3, enable_chunked_prefill=False)
    assert run.tokens == ref and run.partial_chunks == 0
    assert run.config.scheduler_config.max_num_batched_tokens == 96 and not run.config.scheduler_config.enable_chunked_prefill
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=40 is too small: with chunked prefill off "
                                         r"\(--no-enable-chunked-prefill\).*max_model_len \(96\)"):
        LLM(path, max_num_batched_tokens=40, enable_chunked_prefill=False, **KW)
    with pytest.raises(ValueError, match="long_prefill_token_threshold=8 caps prefill chunks"):
        LLM(path, long_prefill_token_threshold=8, enable_chunked_prefill=False, **KW)
    on = Run(path, prompts, GREEDY, max_num_batched_tokens=40)
    assert on.tokens == ref and on.partial_chunks > 0 and on.config.scheduler_config.enable_chunked_prefill


# ------------------------------------------------------------------------------------------ MLA models
def _mla_model(tmp_path_factory, family: str, num_mtp_layers: int, seed: int):
    path = str(tmp_path_factory.mktemp(f"{family}_chunked"))
    _, cfg = make_model(path, seed=seed, num_mtp_layers=num_mtp_layers, family=family)
    prompts = make_prompts(cfg.vocab_size, seed=seed, lens=(1, 40, 9, 23, 4, 31))
    ref = Run(path, prompts, GREEDY, enable_chunked_prefill=False, max_model_len=64)
    long = Run(path, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS + 8, ignore_eos=True),
               enable_chunked_prefill=False, max_model_len=64)
    return path, prompts, ref.tokens, oracle_of(prompts, long.tokens)


@pytest.fixture(scope="module")
def dsv32(tmp_path_factory):
    """DeepSeek-V3.2 tiny (sparse MLA + lightning indexer, ``index_topk`` 6, two MTP layers)."""
    return _mla_model(tmp_path_factory, "deepseek_v32", 2, 11)


@pytest.mark.parametrize("k,chunk,share", [(0, 1, False), (0, 7, False), (3, 1, False), (3, 7, False),
                                           (3, 5, True)])
def test_dsa_chunked_equals_unchunked(dsv32, k, chunk, share):
    """Each chunk's indexer scores its rows against keys earlier chunks cached (selections longer
    than ``index_topk`` really prune); verify rows read context written by several chunks;
    with MTP index sharing the chunks' draft rounds record and reuse their own selection."""
    path, prompts, ref, oracle = dsv32
    extra = {"index_share_for_mtp_iteration": share} if k else None
    runs = [Run(path, prompts, GREEDY, k=k, oracle=oracle, spec_extra=extra, max_model_len=64, **kw)
            for kw in (dict(long_prefill_token_threshold=chunk), dict(enable_chunked_prefill=False))]
    assert runs[0].tokens == ref and runs[1].tokens == ref
    assert runs[0].partial_chunks >= 6
    if k:
        assert runs[0].proposals == runs[1].proposals and runs[0].proposals
        assert sum(1 for h in runs[0].metrics["accepted_length_histogram"] if h) >= 3


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    """DeepSeek-V3 tiny (dense MLA over the latent cache, one MTP layer)."""
    return _mla_model(tmp_path_factory, "deepseek_v3", 1, 13)


def test_dense_mla_verify_rows_after_chunks(dsv3):
    path, prompts, ref, oracle = dsv3
    runs = [Run(path, prompts, GREEDY, k=3, oracle=oracle, max_model_len=64, **kw)
            for kw in (dict(long_prefill_token_threshold=6), dict(enable_chunked_prefill=False))]
    assert runs[0].tokens == ref == runs[1].tokens and runs[0].partial_chunks >= 6
    assert runs[0].proposals == runs[1].proposals


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_mla_triton_kernels_after_chunks(dsv3, dsv32, family, interp, monkeypatch):
    """The same through the Triton kernels (interpreter): chunks of 3 rows with cached context and
    the (1 + k)-row verify rows, in mixed steps, go through the dense MLA decode / verify kernel
    (DeepSeek-V3) or the indexer's logits kernel and sparse MLA (DeepSeek-V3.2)."""
    from mtpspec.attention.backends import indexer, mla
    calls = []
    if family == "deepseek_v3":
        mod, name, data = mla, "mla_attention", dsv3
    else:
        mod, name, data = indexer, "indexer_logits", dsv32
    kernel = getattr(mod, name)
    monkeypatch.setattr(mod, name, lambda *a, **kw: calls.append(a[0].shape[0]) or kernel(*a, **kw))
    path, prompts, ref, oracle = data
    # 4 and 1 tokens: step 1 holds the first's 3-token partial chunk and the second's prefill,
    # step 2 the first's last chunk beside the second's verify rows; then both verify against
    # context that chunks wrote (the interpreter is slow: few steps)
    sub = [prompts[4], prompts[0]]
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    run = Run(path, sub, sp, k=3, oracle=oracle, max_model_len=64, long_prefill_token_threshold=3, max_num_seqs=2)
    assert len(sub[0]) == 4 and len(sub[1]) == 1
    assert run.tokens == [ref[4][:3], ref[0][:3]] and run.partial_chunks == 1
    assert calls and max(calls) == 5  # the mixed step: 1 chunk row + 1 + k verify rows

"""Acceptance counters count only emitted drafts: a stop inside an accepted block.

A brute-force reference replays the blocks that an unstopped run emitted step by step (greedy +
a deterministic draft hook, so a stopped run takes the same steps until its stop) and counts, for
a stop at output index ``s``: one draft per decode step up to the one holding ``s``; accepted =
the accepted drafts of the earlier steps + ``min(accepted, kept)`` of the last one.
"""

from __future__ import annotations

import pytest

from test_engine_fixtures import OracleDrafts, make_model

from mtpspec import LLM, SamplingParams

K = 3
PROMPT = [5, 6, 7]
N_OUT = 42
KW = dict(max_model_len=48, block_size=4, num_kv_blocks=128, max_num_seqs=4, seed=0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_stops"))
    make_model(path, seed=21)
    with LLM(path, speculative_config={"num_speculative_tokens": K}, **KW) as llm:
        greedy = SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True)
        ref = llm.generate([{"prompt_token_ids": PROMPT}], greedy, use_tqdm=False)[0].outputs[0].token_ids
        llm.llm_engine.draft_hook = OracleDrafts({tuple(PROMPT): ref}, 200, corrupt=0.3)
        blocks = []  # the decode blocks of the unstopped run, in order
        execute_async = llm.llm_engine.executor.execute_async

        def recording(step):  # the engine starts each step here and reads its tokens from the handle
            handle = execute_async(step)
            for si, toks in zip(step.seqs, handle.output().new_token_ids):
                if not si.is_prefill:
                    blocks.append(list(toks))
            return handle

        llm.llm_engine.executor.execute_async = recording
        full = llm.generate([{"prompt_token_ids": PROMPT}], greedy, use_tqdm=False)[0].outputs[0].token_ids
        llm.llm_engine.executor.execute_async = execute_async
        assert full == ref and sum(map(len, blocks)) + 1 >= N_OUT
        assert any(len(b) > 2 for b in blocks)  # accepted blocks exist for stops to land in
        yield llm, full, blocks


def reference_counts(blocks, s: int):
    """(num_drafts, num_accepted, per_pos[K], histogram[K + 1]) when output index ``s`` is the last kept."""
    drafts, acc, pos, hist = 0, 0, [0] * K, [0] * (K + 1)
    c = 1  # the prefill emitted output index 0
    for b in blocks:
        if s < c:
            break
        a = len(b) - 1
        kept = min(len(b), s - c + 1)
        e = min(a, kept)
        drafts, acc = drafts + 1, acc + e
        hist[e] += 1
        for j in range(e):
            pos[j] += 1
        c += len(b)
    return drafts, acc, pos, hist


def _params(kind: str, s: int, full):
    base = dict(temperature=0.0, ignore_eos=True)
    if kind == "max_tokens":
        return SamplingParams(max_tokens=s + 1, **base)
    if kind == "stop_token_ids":
        return SamplingParams(max_tokens=N_OUT, stop_token_ids=[full[s]], **base)
    return SamplingParams(max_tokens=N_OUT, stop=[f" w{full[s]}"], **base)


def _cases(full):
    cases = [("max_tokens", s) for s in range(40)]
    firsts = [s for s in range(N_OUT) if full.index(full[s]) == s and full[s] not in (1, 2)]
    text = "".join(f" w{t}" for t in full)
    starts = [len("".join(f" w{t}" for t in full[:s])) for s in range(N_OUT)]
    cases += [("stop_token_ids", s) for s in firsts]
    cases += [("stop", s) for s in firsts if text.find(f" w{full[s]}") == starts[s]]  # ' w1' is in ' w119'

    return cases


def test_acceptance_counts_only_emitted_drafts(setup) -> None:
    llm, full, blocks = setup
    cases = _cases(full)
    assert len(cases) >= 50
    bad = []
    over = 0
    for kind, s in cases:
        llm.reset_metrics()
        out = llm.generate([{"prompt_token_ids": PROMPT}], _params(kind, s, full), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == full[:s + 1], (kind, s)
        drafts, acc, pos, hist = reference_counts(blocks, s)
        r, m = out.metrics, llm.get_metrics()
        got = (r.num_drafts, r.num_accepted_tokens, r.num_accepted_tokens_per_pos or [0] * K,
               r.accepted_length_histogram or [0] * (K + 1))
        eng = (m["num_drafts"], m["num_accepted_tokens"], m["num_accepted_tokens_per_pos"],
               m["accepted_length_histogram"])
        want = (drafts, acc, pos, hist)
        want_len = None if drafts == 0 else 1 + acc / drafts
        if got != want or eng != want or r.acceptance_length != pytest.approx(want_len) \
                or m["acceptance_length"] != pytest.approx(want_len):
            bad.append((kind, s, want, got, eng))
            over += r.num_accepted_tokens > acc
        assert r.num_draft_tokens == m["num_draft_tokens"] == K * drafts
    assert not bad, f"{len(bad)} of {len(cases)} stop cases disagree ({over} over-count); first: {bad[:3]}"

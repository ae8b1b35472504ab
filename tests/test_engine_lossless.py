"""Greedy speculative decoding emits exactly the tokens of greedy plain decoding (tp 1, fp32).

Also the peer check: plain greedy decoding of the tiny random checkpoint equals
``transformers``' own ``Glm4MoeForCausalLM.generate(do_sample=False)``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from test_engine_fixtures import OracleDrafts, make_model, mixed_prompts, token_prompts

from mtpspec import LLM, SamplingParams

MAX_TOKENS = 14
SP = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_lossless"))
    hf, cfg = make_model(path, seed=3)
    return path, hf, cfg


def _llm(path: str, **kw) -> LLM:
    kw.setdefault("max_num_seqs", 4)  # 8 prompts -> admissions while others decode
    return LLM(path, max_model_len=96, block_size=4, num_kv_blocks=256, seed=0, **kw)


@pytest.fixture(scope="module")
def reference(model):
    """Plain greedy outputs (and a longer continuation for the draft oracle)."""
    path, _, cfg = model
    prompts = mixed_prompts(8, cfg.vocab_size, seed=1)
    with _llm(path) as llm:
        outs = llm.generate(token_prompts(prompts), SP, use_tqdm=False)
        long = llm.generate(token_prompts(prompts), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS + 8,
                                                                   ignore_eos=True), use_tqdm=False)
    ref = [o.outputs[0].token_ids for o in outs]
    oracle = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, long)}
    return prompts, ref, oracle


def test_plain_greedy_matches_transformers_generate(model, reference) -> None:
    _, hf, _ = model
    prompts, ref, _ = reference
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    for p, r in zip(prompts, ref):
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
        assert out[0, len(p):].tolist() == r
        assert len(r) == MAX_TOKENS


@pytest.mark.parametrize("k", [1, 3, 5])
def test_spec_equals_plain_with_varied_acceptance(model, reference, k: int) -> None:
    """Drafts from the oracle hook (30% corrupted) so every accepted length occurs; the real MTP
    proposer still runs every step (its drafts are replaced)."""
    path, _, cfg = model
    prompts, ref, oracle = reference
    for local_argmax, fused in [(True, True), (False, False)]:
        with _llm(path, speculative_config={"num_speculative_tokens": k,
                                            "use_local_argmax_reduction": local_argmax},
                  fuse_allreduce_rmsnorm=fused) as llm:
            hook = OracleDrafts(oracle, cfg.vocab_size, corrupt=0.3)
            llm.llm_engine.draft_hook = hook
            for batch in (prompts, prompts[1:2]):
                outs = llm.generate(token_prompts(batch), SP, use_tqdm=False)
                want = [ref[prompts.index(p)] for p in batch]
                assert [o.outputs[0].token_ids for o in outs] == want
            m = llm.get_metrics()
            hist = m["accepted_length_histogram"]
            assert hook.calls > 0 and sum(hist) == m["num_drafts"]
            assert sum(1 for h in hist if h) >= min(3, k + 1), hist  # several accepted lengths occurred
            assert m["num_accepted_tokens"] > 0


@pytest.mark.parametrize("k,local_argmax,fused", [(1, True, False), (3, False, True), (5, True, True)])
def test_spec_equals_plain_with_mtp_drafts(model, reference, k: int, local_argmax: bool, fused: bool) -> None:
    """The real MTP drafts (random layers: mostly rejected) through the whole engine."""
    path = model[0]
    prompts, ref, _ = reference
    with _llm(path, speculative_config={"num_speculative_tokens": k, "use_local_argmax_reduction": local_argmax},
              fuse_allreduce_rmsnorm=fused) as llm:
        outs = llm.generate(token_prompts(prompts), SP, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        for o in outs:
            m = o.metrics
            assert m.num_draft_tokens == k * m.num_drafts and m.num_drafts > 0


def test_preemption_and_resume_give_same_tokens(model, reference) -> None:
    path, _, cfg = model
    prompts, ref, oracle = reference
    # 16 blocks of 4 tokens: a single sequence fits, eight do not -> preemptions by recompute.
    with LLM(path, max_model_len=48, block_size=4, num_kv_blocks=16, max_num_seqs=8, seed=0,
             speculative_config={"num_speculative_tokens": 3}) as llm:
        llm.llm_engine.draft_hook = OracleDrafts(oracle, cfg.vocab_size, corrupt=0.3)
        outs = llm.generate(token_prompts(prompts), SP, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert llm.get_metrics()["num_preemptions"] > 0
        assert sum(o.metrics.num_preemptions for o in outs) > 0


def test_batch_sizes_one_to_eight(model, reference) -> None:
    path, _, cfg = model
    prompts, ref, oracle = reference
    with _llm(path, max_num_seqs=8, speculative_config={"num_speculative_tokens": 3,
                                                        "use_local_argmax_reduction": True}) as llm:
        llm.llm_engine.draft_hook = OracleDrafts(oracle, cfg.vocab_size, corrupt=0.5)
        for n in range(1, 9):
            sub = list(itertools.islice(itertools.cycle(range(8)), n * 3, n * 3 + n))
            outs = llm.generate(token_prompts([prompts[i] for i in sub]), SP, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == [ref[i] for i in sub]


@pytest.mark.parametrize("k,local_argmax", [(1, False), (3, True), (4, False)])
def test_graph_code_path_with_padding_equals_eager(model, reference, k: int, local_argmax: bool) -> None:
    """The CUDA-graph path's static padded buffers (``graph_mode="static"``: no capture on CPU):
    batches of 1..8 run padded to 1, 2, 4, 8 sequences (the draft steps of a step with prompts too);
    padding rows never reach sampling or emission, so tokens equal plain decoding, and the drafts
    equal the eager path's."""
    path, _, cfg = model
    prompts, ref, oracle = reference
    spec = {"num_speculative_tokens": k, "use_local_argmax_reduction": local_argmax}
    seen = {}
    for mode in ("off", "static"):
        with _llm(path, max_num_seqs=8, speculative_config=spec, graph_mode=mode) as llm:
            oracle_hook = OracleDrafts(oracle, cfg.vocab_size, corrupt=0.3)
            drafts = []

            def hook(seq, proposed, _h=oracle_hook, _d=drafts):
                _d.append((tuple(seq.all_token_ids), tuple(proposed)))
                return _h(seq, proposed)

            llm.llm_engine.draft_hook = hook
            if mode == "static":
                assert llm.executor.runner.fwd.sizes == [1, 2, 4, 8]
            for n in (3, 5, 6, 7, 8, 1):
                outs = llm.generate(token_prompts(prompts[:n]), SP, use_tqdm=False)
                assert [o.outputs[0].token_ids for o in outs] == ref[:n]
            assert llm.get_metrics()["num_eager_fallbacks"] == 0
            if mode == "static":  # decode units, and the one-sequence prefill units (n = 1)
                assert llm.executor.runner.fwd.num_graph_steps > 20
                assert llm.executor.runner.fwd.num_prefill_graph_steps >= 1
                # steps of several prompts: their draft steps (k > 1) ran through the step units
                assert (llm.executor.runner.fwd.num_mixed_graph_steps >= 1) == (k > 1)
            seen[mode] = sorted(drafts)
    assert seen["off"] == seen["static"]


def test_plain_decoding_graph_code_path_equals_eager(model, reference) -> None:
    path = model[0]
    prompts, ref, _ = reference
    with _llm(path, max_num_seqs=8, graph_mode="static") as llm:
        for n in (3, 8, 5):
            outs = llm.generate(token_prompts(prompts[:n]), SP, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == ref[:n]
        assert llm.executor.runner.fwd.num_graph_steps > 10

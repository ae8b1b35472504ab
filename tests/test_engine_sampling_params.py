"""presence / frequency / repetition penalties, logit_bias and min_tokens through the engine.

References: a greedy loop over ``transformers``' own model with the edits applied in float64
from the definitions (``test_logits_processors.brute_force``); plain decoding (k = 0) for
speculative decoding (k = 3, drafts from the k = 0 continuation with 30% corrupted, so every
accepted length occurs and the penalty counts must include the accepted drafts of the block),
greedy and seeded; tp 1 for tp 2. min_tokens with the target pushed towards EOS and every draft
an EOS: the verifier must reject them until ``min_tokens``.
"""

from __future__ import annotations

import pytest
import torch

from test_engine_fixtures import OracleDrafts, make_model, mixed_prompts, token_prompts
from test_logits_processors import brute_force

from mtpspec import LLM, SamplingParams
from mtpspec.sample.logits_processors import SeqLogitsParams

MAX_TOKENS = 14
KW = dict(max_model_len=96, block_size=4, num_kv_blocks=256, max_num_seqs=4, seed=0)
EOS_IDS = (1, 2)  # the tiny checkpoints' eos_token_id

CASES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.9),
    "repetition": dict(repetition_penalty=1.8),
    "repetition<1+presence<0": dict(repetition_penalty=0.6, presence_penalty=-0.7),
    "logit_bias": dict(logit_bias={7: 6.0, 130: -5.0, 40: -100.0}),
    "mixed": dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3, logit_bias={1: 4.0},
                  min_tokens=9),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_penalties"))
    hf, cfg = make_model(path, seed=5)
    return path, hf, cfg, mixed_prompts(6, cfg.vocab_size, seed=3)


def _sp(case: str, temperature: float = 0.0, seed: int = 0, **kw) -> SamplingParams:
    args = dict(temperature=temperature, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)
    args.update(CASES[case])
    args.update(kw)
    return SamplingParams(**args)


def _run(path, prompts, params, k=0, hook=None, **kw):
    spec = {"num_speculative_tokens": k} if k else None
    with LLM(path, speculative_config=spec, **{**KW, **kw}) as llm:
        if hook is not None:
            llm.llm_engine.draft_hook = hook
        outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.get_metrics(), outs


@pytest.fixture(scope="module")
def plain(model):
    """k = 0 greedy outputs per case, unpenalised first."""
    path, _, _, prompts = model
    out = {"none": _run(path, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))[0]}
    for case in CASES:
        out[case] = _run(path, prompts, _sp(case))[0]
    return out


def _hf_greedy(hf, prompt, sp: SamplingParams):
    outs = []
    for _ in range(sp.max_tokens):
        with torch.no_grad():
            row = hf(torch.tensor([prompt + outs])).logits[0, -1]
        p = SeqLogitsParams(sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, list(outs),
                            sorted(set(prompt)), sorted((sp.logit_bias or {}).items()),
                            max(0, sp.min_tokens - len(outs)), list(EOS_IDS))
        outs.append(int(torch.from_numpy(brute_force(row, p)).argmax()))
    return outs


@pytest.mark.parametrize("case", list(CASES))
def test_plain_greedy_equals_float64_reference(model, plain, case) -> None:
    _, hf, _, prompts = model
    assert plain[case] != plain["none"]  # the parameter changes the outputs
    for p, got in zip(prompts, plain[case]):
        assert got == _hf_greedy(hf, p, _sp(case)), case


@pytest.mark.parametrize("case,graph_mode", [(c, "off") for c in CASES] + [("mixed", "static")])
def test_spec_greedy_equals_plain(model, plain, case, graph_mode) -> None:
    """k = 3 token for token == k = 0; ``static``: the CUDA-graph code path (padded buffers)."""
    path, _, cfg, prompts = model
    oracle = {tuple(p): t + [3] * 4 for p, t in zip(prompts, plain[case])}
    got, m, _ = _run(path, prompts, _sp(case), k=3, hook=OracleDrafts(oracle, cfg.vocab_size, corrupt=0.3),
                     graph_mode=graph_mode)
    assert got == plain[case]
    hist = m["accepted_length_histogram"]
    assert sum(1 for h in hist if h) >= 3 and m["num_accepted_tokens"] > 10, hist
    if graph_mode == "static":
        assert m["num_eager_fallbacks"] == 0


def test_chunked_prefill_equals_plain(model, plain) -> None:
    """Prompts prefilled 3 tokens a step (no sampling, no edits for the partial chunks) give the
    same penalised / biased / min_tokens greedy tokens, k = 3."""
    path, _, cfg, prompts = model
    oracle = {tuple(p): t + [3] * 4 for p, t in zip(prompts, plain["mixed"])}
    got, m, _ = _run(path, prompts, _sp("mixed"), k=3, hook=OracleDrafts(oracle, cfg.vocab_size, corrupt=0.3),
                     long_prefill_token_threshold=3)
    assert got == plain["mixed"] and m["num_accepted_tokens"] > 10


@pytest.mark.parametrize("case", ["presence", "repetition", "mixed"])
def test_spec_seeded_sampling_equals_plain(model, case) -> None:
    """Seeded rejection sampling of the penalised distribution draws the same tokens at any k."""
    path, _, cfg, prompts = model
    params = [_sp(case, temperature=0.9, seed=100 + i, top_p=0.95) for i in range(len(prompts))]
    ref, _, _ = _run(path, prompts, params)
    unpen, _, _ = _run(path, prompts, [SamplingParams(temperature=0.9, seed=100 + i, top_p=0.95,
                                                      max_tokens=MAX_TOKENS, ignore_eos=True)
                                       for i in range(len(prompts))])
    assert ref != unpen
    oracle = {tuple(p): t + [3] * 4 for p, t in zip(prompts, ref)}
    got, m, _ = _run(path, prompts, params, k=3, hook=OracleDrafts(oracle, cfg.vocab_size, corrupt=0.3))
    assert got == ref and m["num_accepted_tokens"] > 10


class EOSDrafts:
    """Every draft is an EOS id."""

    def __call__(self, seq, proposed):
        return [EOS_IDS[0]] * len(proposed)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_min_tokens_with_eos_drafts(model, k) -> None:
    """logit_bias makes EOS the target's favourite; min_tokens keeps it (and a stop id) out of the
    first tokens, also when every draft is EOS (the verifier must not accept them), then the
    request stops at the first EOS / stop id."""
    path, _, _, prompts = model
    eos = EOS_IDS[0]
    bias = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logit_bias={eos: 40.0})
    free, _, _ = _run(path, prompts, bias)
    assert all(t == [eos] for t in free)  # without min_tokens: EOS at once (the test has power)
    stop_tok = 50
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logit_bias={eos: 40.0}, min_tokens=5),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logit_bias={stop_tok: 40.0}, min_tokens=4,
                             stop_token_ids=[stop_tok]),
              SamplingParams(temperature=0.7, seed=3, max_tokens=MAX_TOKENS, logit_bias={eos: 40.0}, min_tokens=6)]
    got, m, outs = _run(path, prompts[:3], params, k=k, hook=EOSDrafts() if k else None)
    for o, sp in zip(outs, params):
        c = o.outputs[0]
        assert c.finish_reason == "stop" and len(c.token_ids) == sp.min_tokens + 1, c
        assert not set(c.token_ids[:-1]) & {*EOS_IDS, stop_tok}
    assert outs[0].outputs[0].token_ids[-1] == eos and outs[1].outputs[0].stop_reason == stop_tok
    if k:
        ref, _, _ = _run(path, prompts[:3], params)
        assert got == ref
        # an EOS draft is accepted only as the final token of the two EOS-stopped requests
        assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] <= 2


def test_stop_strings_wait_for_min_tokens(model) -> None:
    """vLLM: stop strings are looked for once more than min_tokens tokens exist, in text that ends
    after the min_tokens-th token."""
    path, _, _, prompts = model
    base = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(path, speculative_config={"num_speculative_tokens": 2}, **KW) as llm:
        full = llm.generate(token_prompts(prompts[:1]), SamplingParams(**base), use_tqdm=False)[0].outputs[0]
        head = llm.generate(token_prompts(prompts[:1]), SamplingParams(**{**base, "max_tokens": 4}),
                            use_tqdm=False)[0].outputs[0].text
        stop = full.text[2:5]
        early = llm.generate(token_prompts(prompts[:1]), SamplingParams(**base, stop=[stop]), use_tqdm=False)
        late = llm.generate(token_prompts(prompts[:1]), SamplingParams(**base, stop=[stop], min_tokens=4),
                            use_tqdm=False)
    assert early[0].outputs[0].text == full.text[:2] and len(early[0].outputs[0].token_ids) <= 2
    pos = full.text.find(stop, len(head) - len(stop) + 1)
    lc = late[0].outputs[0]
    if pos < 0:
        assert lc.finish_reason == "length" and lc.text == full.text
    else:
        assert lc.finish_reason == "stop" and lc.text == full.text[:pos] and len(lc.token_ids) > 4


@pytest.mark.parametrize("kwargs,match", [
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),
    (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\], got -3"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be in"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero, got 0.0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number"),
    (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens must be less than or equal to max_tokens=10, got 20"),
    (dict(min_tokens=1.5), "min_tokens must be greater than or equal to 0"),
    (dict(logit_bias={"5": 1.0}), "logit_bias keys must be token ids"),
    (dict(logit_bias={5: float("inf")}), "logit_bias values must be finite numbers"),
    (dict(logit_bias=[5, 1.0]), "logit_bias must be a dict"),
    (dict(presence_penalty="1"), "presence_penalty must be in"),
    # 64 bits, what torch.Generator.manual_seed takes (a new-user pass, 2026-12-06: seeds 2**64 and 2**70 wrapped
    # to the same draws; random.getrandbits(64) stays valid)
    (dict(seed=2 ** 64), r"seed must be in \[-2\*\*63, 2\*\*64 - 1\] \(64 bits\), got 18446744073709551616"),
    (dict(seed=-2 ** 63 - 1), r"seed must be in \[-2\*\*63"),
])
def test_bad_values_name_the_field(kwargs, match) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(min_p=0.05), r"'min_p' is a vLLM field mtpspec does not implement \(use top_k / top_p\); the fields are: n, "),
    (dict(guided_decoding={"json": {}}), r"'guided_decoding' is a vLLM field mtpspec does not implement; the fields"),
    (dict(tempreature=0.5), r"unknown field 'tempreature'; the fields are: .*temperature"),
    (dict(_stop_list=["x"]), r"unknown field '_stop_list'"),  # not an argument, though a dataclass field
])
def test_fields_it_lacks_are_named_with_the_fields_it_has(kwargs, match) -> None:
    with pytest.raises(TypeError, match=match):
        SamplingParams(max_tokens=4, **kwargs)
    import copy
    import dataclasses
    import pickle
    sp = SamplingParams(temperature=0.5, stop=["a"], max_tokens=4)  # copies and pickles still rebuild it
    assert pickle.loads(pickle.dumps(sp)) == sp == copy.deepcopy(sp) and dataclasses.replace(sp, top_k=3).top_k == 3
    import inspect
    assert list(inspect.signature(SamplingParams).parameters)[:3] == ["n", "best_of", "temperature"]  # not **kwargs

    @dataclasses.dataclass(init=False)
    class Aliased(SamplingParams):  # a subclass whose own __init__ takes more keywords is not checked
        def __init__(self, my_alias=None, **kw):
            super().__init__(**kw)
            self.my_alias = my_alias

    assert Aliased(my_alias=3, max_tokens=2).my_alias == 3
    with pytest.raises(TypeError, match="Aliased: 'min_p' is a vLLM field"):  # its keywords reach the check
        Aliased(min_p=0.1)

    @dataclasses.dataclass
    class More(SamplingParams):
        extra: int = 0

    assert More(extra=2).extra == 2 and "extra" in inspect.signature(More).parameters


def test_vllm_fields_at_their_off_value_are_accepted() -> None:
    """A vLLM field mtpspec lacks, given the value that asks for nothing (Qwen's recommended
    ``min_p=0``, ``guided_decoding=None``, ...), is dropped: it was a TypeError, so settings copied
    from vLLM failed; any other value still is one."""
    sp = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, min_p=0, guided_decoding=None, structured_outputs=None,
                        logits_processors=[], bad_words=None, spaces_between_special_tokens=True,
                        truncate_prompt_tokens=None, extra_args=None)
    assert sp == SamplingParams(temperature=0.6, top_p=0.95, top_k=20)
    for kw in (dict(min_p=0.1), dict(min_p=False), dict(bad_words=["x"])):
        with pytest.raises(TypeError, match=f"'{next(iter(kw))}' is a vLLM field"):
            SamplingParams(**kw)


def test_stop_set_after_construction_is_used() -> None:
    """Found by a new-user review (2026-12-05): ``sp.stop = [...]`` after construction was ignored (the
    list checked in ``__post_init__`` was kept); now it is checked again and used, and a bad one raises."""
    sp = SamplingParams(max_tokens=4)
    sp.stop = ["is", "was"]
    assert sp.stop_strings == ["is", "was"]
    sp.stop = "x"
    assert sp.stop_strings == ["x"]
    sp.stop = [3]
    with pytest.raises((TypeError, ValueError), match="stop"):
        sp.stop_strings


def test_fields_set_after_construction_are_checked_at_submission(model) -> None:
    """Found by a new-user review (2026-12-05): ``sp.temperature = -5.0`` after construction failed
    inside the sampler (AttributeError); it is now the constructor's error, before any work starts."""
    path, _, _, _ = model
    with LLM(path, **KW) as llm:
        sp = SamplingParams(max_tokens=2, temperature=0.5)
        sp.temperature = -5.0
        with pytest.raises(ValueError, match=r"prompt 0: temperature must be a finite number >= 0, got -5.0"):
            llm.generate([{"prompt_token_ids": [5]}], sp, use_tqdm=False)
        sp.temperature, sp.max_tokens = 0.0, "x"
        with pytest.raises(ValueError, match=r"max_tokens must be an int >= 1 or None, got 'x'"):
            llm.generate([{"prompt_token_ids": [5]}], sp, use_tqdm=False)
        sp.max_tokens = 2  # the engine is unharmed
        assert len(llm.generate([{"prompt_token_ids": [5]}], sp, use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_engine_checks_logit_bias_and_stop_token_ids(model) -> None:
    path, _, cfg, _ = model
    with LLM(path, **KW) as llm:
        with pytest.raises(ValueError, match=rf"prompt 0: token_id\(s\) \[{cfg.vocab_size}\] in logit_bias contain "
                                             rf"out-of-vocab token ids. Vocabulary size: {cfg.vocab_size}"):
            llm.generate([{"prompt_token_ids": [5]}], SamplingParams(logit_bias={cfg.vocab_size: 1.0}), use_tqdm=False)
        # a stop id the model cannot generate is refused as the server refuses it (400), not silently never matched
        with pytest.raises(ValueError, match=rf"prompt 1: stop_token_ids \[{cfg.vocab_size + 5}\] are outside the "
                                             rf"vocabulary \[0, {cfg.vocab_size}\)"):
            llm.generate([{"prompt_token_ids": [5]}] * 2, [SamplingParams(max_tokens=2),
                         SamplingParams(stop_token_ids=[3, cfg.vocab_size + 5])], use_tqdm=False)
        assert len(llm.generate([{"prompt_token_ids": [5]}], SamplingParams(max_tokens=2, stop_token_ids=[
            cfg.vocab_size - 1]), use_tqdm=False)[0].outputs[0].token_ids) <= 2  # the last id is in the vocabulary


def test_tp2_equals_tp1(model, plain) -> None:
    """Penalties, logit_bias and min_tokens at tp 2 (every rank edits the gathered logits the same way)."""
    path, _, cfg, prompts = model
    oracle = {tuple(p): t + [3] * 4 for p, t in zip(prompts, plain["mixed"])}
    got, _, _ = _run(path, prompts, _sp("mixed"), k=3, hook=OracleDrafts(oracle, cfg.vocab_size, corrupt=0.3),
                     tensor_parallel_size=2)
    assert got == plain["mixed"]


def test_a_tiny_temperature_is_raised_to_vllm_s_minimum() -> None:
    """Found by a new-user pass (2026-12-07): ``temperature: 1e-46`` (> 0, so sampling) became 0 in the
    sampler's float32 tensor, whose ``t > 0`` test then divided by 1: the request was sampled at
    temperature 1. As vLLM (``_MAX_TEMP``), a temperature in (0, 0.01) is raised to 0.01 (sampling, so
    ``n > 1`` stays allowed); 0 alone is greedy."""
    for t in (1e-46, 1e-320, 9.9e-6, 0.005):
        assert SamplingParams(temperature=t).temperature == 0.01
        assert SamplingParams(temperature=t, n=2).n == 2
    assert SamplingParams(temperature=0.01).temperature == 0.01 and SamplingParams(temperature=0.0).temperature == 0


@pytest.mark.parametrize("k", [0, 2])
def test_detokenize_false_gives_the_same_ids_and_no_text(model, plain, k, monkeypatch) -> None:
    """vLLM's ``detokenize=False`` (was a TypeError): the same greedy token ids, with and without
    speculative decoding; ``text`` is "" and no logprob entry carries a decoded token; the
    sequence's detokenizer is never run (its per-token host cost is saved)."""
    from mtpspec.engine.detokenizer import IncrementalDetokenizer
    path, _, _, prompts = model
    calls = []
    add = IncrementalDetokenizer.add
    monkeypatch.setattr(IncrementalDetokenizer, "add", lambda self, tok: calls.append(tok) or add(self, tok))
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                        detokenize=False)
    got, _, outs = _run(path, prompts, sp, k=k)
    assert got == plain["none"] and not calls
    for o in outs:
        c = o.outputs[0]
        assert c.text == "" and len(c.logprobs) == len(c.token_ids)
        assert all(lp.decoded_token is None for d in c.logprobs + o.prompt_logprobs[1:] for lp in d.values())
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    _, _, outs = _run(path, prompts[:1], sp, k=k)
    c = outs[0].outputs[0]  # the tokenizer is there: detokenize=True makes text
    assert c.text and calls and all(lp.decoded_token is not None for d in c.logprobs for lp in d.values())


def test_detokenize_false_refuses_stop_strings(model) -> None:
    """vLLM's rule and message; also for ``stop`` set after construction (checked at submission)
    and for ``LLM.chat``'s plain template, whose answers end at a stop string."""
    msg = "stop strings are only supported when detokenize is True"
    with pytest.raises(ValueError, match=msg):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(TypeError, match="detokenize must be a bool"):
        SamplingParams(detokenize="false")
    SamplingParams(stop_token_ids=[3], detokenize=False)  # stop ids need no text
    path, _, _, _ = model
    with LLM(path, **KW) as llm:
        sp = SamplingParams(max_tokens=2, detokenize=False)
        sp.stop = "w5"
        with pytest.raises(ValueError, match=msg):
            llm.generate([{"prompt_token_ids": [5]}], sp, use_tqdm=False)
        with pytest.raises(ValueError, match="conversation 0: the plain Question: / Answer: template .* stop "
                                             "strings need detokenize=True"):
            llm.chat([{"role": "user", "content": "w5 w6"}], SamplingParams(max_tokens=2, detokenize=False))
        out = llm.chat([{"role": "user", "content": "w5 w6"}], SamplingParams(max_tokens=2, detokenize=False),
                       chat_template="{% for m in messages %}{{ m.content }} {% endfor %}", use_tqdm=False)
        assert out[0].outputs[0].text == "" and len(out[0].outputs[0].token_ids) == 2


def test_an_empty_allowed_token_ids_is_not_vllm_s_off_value() -> None:
    """``allowed_token_ids=[]`` allows no token (vLLM refuses it: "allowed_token_ids is not None and empty!");
    dropped as an "off" value it sampled from the whole vocabulary. ``None`` is the off value."""
    with pytest.raises(TypeError, match="'allowed_token_ids' is a vLLM field"):
        SamplingParams(allowed_token_ids=[])
    assert SamplingParams(allowed_token_ids=None) == SamplingParams()

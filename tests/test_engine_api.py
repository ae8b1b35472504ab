"""LLM API behaviour on a tiny checkpoint (tp 1): bad inputs, start-up errors, stopping, seeds, metrics."""

from __future__ import annotations

import math

import pytest

from test_engine_fixtures import OracleDrafts, make_model, token_prompts

from mtpspec import LLM, SamplingParams
from mtpspec.spec_decode.mtp_proposer import LocalArgmaxUnsupportedError

KW = dict(max_model_len=48, block_size=4, num_kv_blocks=128, max_num_seqs=4, seed=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("tiny_api"))
    make_model(p, seed=21)
    return p


@pytest.fixture(scope="module")
def llm(path):
    with LLM(path, speculative_config={"num_speculative_tokens": 2}, **KW) as m:
        yield m


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("prompt,err,match", [
    ({"prompt_token_ids": []}, ValueError, "prompt 1: the prompt is empty"),
    ("", ValueError, "prompt 1: the prompt is empty"),
    ({"prompt_token_ids": list(range(3, 51))}, ValueError, "prompt 1: This model.s maximum context length is 48 tokens. "
     "However, your request has 48 input tokens"),
    ({"prompt_token_ids": [5, 200]}, ValueError, "prompt 1: prompt token id 200 is outside the vocabulary"),
    ({"prompt_token_ids": [5, -1]}, ValueError, "outside the vocabulary"),
    ({"prompt_token_ids": [5, 1.5]}, TypeError, "list of ints"),
    ({"text": "w5"}, ValueError, "'prompt' or 'prompt_token_ids'"),
    (7, TypeError, "a prompt must be a string"),
])
def test_bad_prompt_raises_before_work_and_leaves_engine_usable(llm, prompt, err, match) -> None:
    good = {"prompt_token_ids": [5, 6, 7]}
    before = _ids(llm.generate([good], GREEDY, use_tqdm=False))
    steps = llm.get_metrics()["num_steps"]
    with pytest.raises(err, match=match):
        llm.generate([good, prompt], GREEDY, use_tqdm=False)
    assert llm.get_metrics()["num_steps"] == steps  # nothing ran
    assert not llm.llm_engine.has_unfinished_requests()
    assert _ids(llm.generate([good], GREEDY, use_tqdm=False)) == before


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_p=math.nan), "top_p"), (dict(top_k=-2), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(temperature=True), "temperature"),
])
def test_bad_sampling_params(kwargs, match) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**kwargs)


def test_stop_token_ids_take_numpy_integers_as_python_ints() -> None:
    """Ids taken from a numpy array (or the 1-D array itself) work, as in vLLM, and are kept as Python
    ints; a bool, a float or a negative numpy integer is still refused."""
    import numpy as np
    ids = SamplingParams(stop_token_ids=list(np.array([5, 7], dtype=np.int64)) + [np.int32(9)]).stop_token_ids
    assert ids == [5, 7, 9] and all(type(t) is int for t in ids)
    assert SamplingParams(stop_token_ids=np.array([3, 4], dtype=np.uint32)).stop_token_ids == [3, 4]  # an array
    for bad in ([True], [5.0], [np.int64(-1)], [np.float32(3)]):
        with pytest.raises((ValueError, TypeError), match="stop_token_ids"):
            SamplingParams(stop_token_ids=bad)


@pytest.mark.parametrize("spec,match", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"), ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "method": "eagle"}, "method"), ({"k": 2}, "unknown speculative_config keys"),
])
def test_bad_speculative_config(path, spec, match) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(path, speculative_config=spec, **KW)


def test_bad_engine_limits(path) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(path, max_model_len=10_000)
    with pytest.raises(ValueError, match="KV cache"):
        LLM(path, max_model_len=48, block_size=4, num_kv_blocks=5)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(path, tensor_parallel_size=0)


@pytest.mark.parametrize("device,match", [("tpu", "device must be"), (3, "device must be"),
                                          ("cuda", "sees no CUDA GPU"), ("cuda:1", "sees no CUDA GPU")])
def test_bad_device_is_a_clear_value_error(path, device, match, monkeypatch) -> None:
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only machine, also on a GPU box
    with pytest.raises(ValueError, match=match):
        LLM(path, device=device, **KW)


def test_local_argmax_requested_from_model_without_it(path, monkeypatch) -> None:
    from mtpspec.models.glm4_moe_mtp import Glm4MoeMTP
    monkeypatch.setattr(Glm4MoeMTP, "supports_local_argmax", False)
    with pytest.raises(LocalArgmaxUnsupportedError, match="Glm4MoeMTP"):
        LLM(path, speculative_config={"num_speculative_tokens": 2, "use_local_argmax_reduction": True}, **KW)
    # without the flag the same model starts (baseline arm: compute_logits + argmax)
    LLM(path, speculative_config={"num_speculative_tokens": 2}, **KW).shutdown()


def test_max_tokens_one_and_eos(llm) -> None:
    outs = llm.generate(token_prompts([[5, 6], [9]]), SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    for o in outs:
        assert len(o.outputs[0].token_ids) == 1 and o.outputs[0].finish_reason in ("length", "stop")
        assert o.metrics.num_drafts == 0 and o.finished
    # EOS: find a prompt whose greedy continuation hits an EOS id (1 or 2) and check the stop.
    full = llm.generate(token_prompts([[p] for p in range(3, 60)]), GREEDY, use_tqdm=False)
    hits = [(i, o.outputs[0].token_ids) for i, o in enumerate(full) if {1, 2} & set(o.outputs[0].token_ids)]
    assert hits, "no prompt reaches EOS; pick another seed"
    i, toks = hits[0]
    cut = next(j for j, t in enumerate(toks) if t in (1, 2))
    out = llm.generate([{"prompt_token_ids": [3 + i]}], SamplingParams(temperature=0.0, max_tokens=10),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == toks[:cut + 1] and out.finish_reason == "stop" and out.stop_reason is None


def test_stop_strings_and_stop_token_ids(llm) -> None:
    outs = llm.generate(["w5 w6 w7"], GREEDY, use_tqdm=False)
    toks, text = outs[0].outputs[0].token_ids, outs[0].outputs[0].text
    assert text == "".join(f" w{t}" for t in toks)
    # stop on the 4th token's word: text cut before it, tokens up to the one that completed it
    stop = f" w{toks[3]}"
    first = text.index(stop)
    o = llm.generate(["w5 w6 w7"], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=[stop, "zz"]),
                     use_tqdm=False)[0].outputs[0]
    n_tok = next(j for j in range(len(toks)) if len("".join(f" w{t}" for t in toks[:j + 1])) >= first + len(stop))
    assert o.text == text[:first] and o.finish_reason == "stop" and o.stop_reason == stop
    assert o.token_ids == toks[:n_tok + 1]
    o = llm.generate(["w5 w6 w7"], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                  stop_token_ids=[toks[2]]), use_tqdm=False)[0].outputs[0]
    j = toks.index(toks[2])
    assert o.token_ids == toks[:j + 1] and o.stop_reason == toks[2]


def test_seeded_sampling_is_reproducible_across_batches_and_preemption(path, llm) -> None:
    sp = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=s, max_tokens=12, ignore_eos=True)
          for s in (1, 2, 3)]
    prompts = token_prompts([[5, 6, 7], [8, 9], [10, 11, 12, 13]])
    a = _ids(llm.generate(prompts, sp, use_tqdm=False))
    b = _ids(llm.generate(prompts[::-1], sp[::-1], use_tqdm=False))[::-1]
    c = _ids(llm.generate(prompts[1:2], sp[1:2], use_tqdm=False))
    assert a == b and c == a[1:2]
    assert a[0] != a[1] and len(set(a[0])) > 3  # really sampling
    with LLM(path, speculative_config={"num_speculative_tokens": 2}, max_model_len=48, block_size=4,
             num_kv_blocks=14, max_num_seqs=4, seed=0) as tight:
        d = _ids(tight.generate(prompts, sp, use_tqdm=False))
        assert tight.get_metrics()["num_preemptions"] > 0
    assert d == a
    # unseeded requests draw their seeds from the engine seed: same LLM seed -> same tokens
    un = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    with LLM(path, **KW) as x, LLM(path, **KW) as y:
        assert _ids(x.generate(prompts, un, use_tqdm=False)) == _ids(y.generate(prompts, un, use_tqdm=False))


def test_metrics_arithmetic(path) -> None:
    k = 3
    with LLM(path, speculative_config={"num_speculative_tokens": k}, **KW) as llm:
        prompts = [[5, 6, 7], [9], [11, 12, 13, 14, 15]]
        ref = llm.generate(token_prompts(prompts), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                           use_tqdm=False)
        llm.reset_metrics()
        oracle = OracleDrafts({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, ref)}, 200, corrupt=0.3)
        llm.llm_engine.draft_hook = oracle
        outs = llm.generate(token_prompts(prompts), GREEDY, use_tqdm=False)
        m = llm.get_metrics()
    per = [o.metrics for o in outs]
    assert m["num_drafts"] == sum(r.num_drafts for r in per) > 0
    assert m["num_draft_tokens"] == k * m["num_drafts"]
    assert m["num_accepted_tokens"] == sum(r.num_accepted_tokens for r in per)
    hist = m["accepted_length_histogram"]
    assert len(hist) == k + 1 and sum(hist) == m["num_drafts"]
    assert sum(a * c for a, c in enumerate(hist)) == m["num_accepted_tokens"]
    pos = m["num_accepted_tokens_per_pos"]
    assert len(pos) == k and sum(pos) == m["num_accepted_tokens"] and sorted(pos, reverse=True) == pos
    assert pos[0] == sum(hist[1:]) and pos[-1] == hist[k]
    assert m["acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
    assert m["acceptance_rate"] == pytest.approx(m["num_accepted_tokens"] / m["num_draft_tokens"])
    assert m["num_output_tokens"] == sum(len(o.outputs[0].token_ids) for o in outs) == 30
    assert m["output_tokens_per_s"] == pytest.approx(30 / m["busy_time_s"])
    assert m["num_eager_fallbacks"] == 0 and m["comm_bytes_total"] == {}  # tp 1: nothing communicated
    for r, o in zip(per, outs):
        assert r.ttft is not None and r.ttft > 0 and r.first_token_time <= r.last_token_time <= r.finished_time
        assert len(r.itl) == r.num_drafts and all(x >= 0 for x in r.itl)
        # prefill emits 1, each decode 1 + accepted; only the last step may overshoot max_tokens
        dropped = 1 + r.num_drafts + r.num_accepted_tokens - r.num_output_tokens
        assert 0 <= dropped <= k
        assert r.acceptance_length == pytest.approx(1 + r.num_accepted_tokens / r.num_drafts)



def test_eager_fallbacks_are_counted_and_logged_once(path, caplog) -> None:
    """graph_mode="cuda" where capture cannot work (CPU): every pure-decode step runs eagerly,
    each one is counted, the reason is logged once, and the tokens are unchanged."""
    import logging
    prompts = token_prompts([[5, 6, 7], [9, 10]])
    with LLM(path, speculative_config={"num_speculative_tokens": 2}, **KW) as ref_llm:
        ref = _ids(ref_llm.generate(prompts, GREEDY, use_tqdm=False))
    with caplog.at_level(logging.WARNING, logger="mtpspec.engine.forward"):
        with LLM(path, speculative_config={"num_speculative_tokens": 2}, graph_mode="cuda", **KW) as llm:
            assert llm.executor.runner.fwd.capture_failed
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            m = llm.get_metrics()
    assert _ids(outs) == ref
    decode_steps = m["num_steps"] - 1  # both prompts prefill in the first step, then pure decodes
    assert m["num_eager_fallbacks"] == decode_steps > 0
    step_warnings = [r for r in caplog.records if "runs eagerly instead of through a CUDA graph" in r.getMessage()]
    assert len(step_warnings) == 1


def test_shutdown_releases_the_in_process_runner(path, monkeypatch) -> None:
    """At tp 1, ``shutdown()`` frees the weights, KV cache and graphs (as spawned ranks do by
    exiting) and returns cached CUDA memory, so a next ``LLM`` in the same process can size its KV
    cache from the free memory; steps after it are a clear error."""
    import gc
    import weakref

    import torch

    from mtpspec.engine.executor import WorkerError
    emptied = []
    llm = LLM(path, speculative_config={"num_speculative_tokens": 2}, **KW)
    first = _ids(llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False))
    runner, target = weakref.ref(llm.executor.runner), weakref.ref(llm.executor.runner.target)
    with monkeypatch.context() as m:  # as if on a GPU: the allocator's cache is emptied
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "is_initialized", lambda: True)
        m.setattr(torch.cuda, "synchronize", lambda *a: None)
        m.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
        llm.shutdown()
    gc.collect()
    assert runner() is None and target() is None and emptied == [1]
    llm.shutdown()  # idempotent
    with pytest.raises(WorkerError, match="shut down"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    with LLM(path, speculative_config={"num_speculative_tokens": 2}, **KW) as again:
        assert _ids(again.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)) == first


def test_generate_rejects_a_non_prompt_argument_clearly():
    from mtpspec import LLM
    llm = LLM.__new__(LLM)  # the check runs before any engine work
    for bad in (None, 5, b"text"):
        with pytest.raises(TypeError, match="prompts must be a string"):
            llm.generate(bad)


def test_plain_decoding_metrics_have_the_headline_figures(path) -> None:
    """``get_metrics()["acceptance_length"]`` is None without speculative decoding (a script that
    reads it raised KeyError at k = 0), while the draft counters stay absent."""
    with LLM(path, **KW) as llm:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
        m = llm.get_metrics()
    assert m["acceptance_length"] is None and m["acceptance_rate"] is None and "num_drafts" not in m
    assert m["num_output_tokens"] == 10


def test_vllm_lora_priority_and_pooling_are_clear_refusals(llm) -> None:
    """vLLM's ``lora_request`` / ``priority`` arguments and its pooling / beam-search methods: a
    ValueError naming them before any work (they were a TypeError "unexpected keyword argument" and
    an AttributeError); their "nothing asked" values are accepted."""
    good = {"prompt_token_ids": [5, 6, 7]}
    steps = llm.get_metrics()["num_steps"]
    for kw in (dict(lora_request=object()), dict(lora_request=[None, object()]), dict(priority=[1])):
        with pytest.raises(ValueError, match="LoRA" if "lora_request" in kw else "priority"):
            llm.generate([good], GREEDY, use_tqdm=False, **kw)
    with pytest.raises(ValueError, match="LoRA"):
        llm.chat([{"role": "user", "content": "w5"}], GREEDY, lora_request=object())
    for name in ("encode", "embed", "classify", "score", "reward", "beam_search"):
        with pytest.raises(ValueError, match=rf"LLM\.{name}\(\) is not supported"):
            getattr(llm, name)([good])
    assert llm.get_metrics()["num_steps"] == steps and not llm.llm_engine.has_unfinished_requests()
    assert llm.generate([good], GREEDY, use_tqdm=False, lora_request=None, priority=[0])[0].finished


def test_use_tqdm_callable_is_the_progress_bar(llm) -> None:
    """vLLM's ``use_tqdm`` may be a tqdm-like callable: it makes the bar (it was ignored: a plain tqdm)."""
    bars = []

    class Bar:
        def __init__(self, total, **kw):
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            self.closed = True

    llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8]}], GREEDY, use_tqdm=Bar)
    assert [(b.total, b.n, b.closed) for b in bars] == [(2, 2, True)]


def test_a_hub_id_or_missing_folder_says_mtpspec_loads_local_folders(tmp_path) -> None:
    """``LLM("org/name")``, vLLM's usual form, said only "no config.json in 'org/name'"; now the
    message says mtpspec does not download Hub ids and how to get the folder (as the CLI does)."""
    with pytest.raises(FileNotFoundError, match=r"does not download Hugging Face Hub ids .*then pass DIR as model\)"):
        LLM("zai-org/GLM-4.5-Air")
    with pytest.raises(FileNotFoundError, match="has no config.json: model takes a checkpoint folder"):
        LLM(tmp_path)

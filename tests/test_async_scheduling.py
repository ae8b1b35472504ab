"""Async scheduling (issue 18): the engine applies a step's tokens and schedules the next step
while the step's draft passes run; the drafts are taken only when the next step is built. With
k = 0 the next step is scheduled and launched before the last one's tokens are applied (its
decodes one position ahead, their newest token filled on the device).

Contract: the same outputs token for token as the engine that waits for each whole step
(``async_scheduling=False``), greedy and seeded sampling, k = 0 / 1 / 3, with stop ids, EOS,
``max_tokens``, preemption (a KV cache too small for every sequence) and aborts mid-run (at k = 0
the aborted request may miss the token of the step in flight); and the order of the host's waits
(a step returns before its drafts are read).
"""

from __future__ import annotations

import pytest

from test_engine_fixtures import make_model, mixed_prompts, token_prompts

from mtpspec import LLM, SamplingParams


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_async"))
    _, cfg = make_model(path, seed=5)
    return path, cfg


def _llm(path: str, k: int, async_scheduling: bool, num_kv_blocks: int = 256) -> LLM:
    spec = {"num_speculative_tokens": k} if k else None
    return LLM(path, speculative_config=spec, max_model_len=48, block_size=4, num_kv_blocks=num_kv_blocks,
               max_num_seqs=4, seed=0, async_scheduling=async_scheduling)


def _params(i: int, vocab: int):
    """Greedy and seeded rows, with stop ids, EOS, different lengths, and penalties (whose rows
    count the drafts: their decodes take the drafts on the host)."""
    if i % 4 == 0:
        return SamplingParams(temperature=0.0, max_tokens=10 + i, ignore_eos=True)
    if i % 4 == 1:
        return SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=16, stop_token_ids=[7, 11])
    if i % 4 == 2:
        return SamplingParams(temperature=0.7, seed=200 + i, max_tokens=12)
    return SamplingParams(temperature=0.8, seed=300 + i, max_tokens=14, frequency_penalty=0.5, min_tokens=4)


def _run(llm: LLM, prompts, vocab: int, abort_at: int = -1):
    """Step the engine by hand; abort request "3" after ``abort_at`` steps. Returns
    ``{request id: (token ids, finish reason)}`` of every request."""
    eng = llm.llm_engine
    for i, p in enumerate(token_prompts(prompts)):
        eng.add_request(p, _params(i, vocab), request_id=str(i))
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = (o.outputs[0].token_ids, o.outputs[0].finish_reason)
        steps += 1
        if steps == abort_at:
            o = eng.abort_request("3")
            if o is not None:
                done["3"] = (o.outputs[0].token_ids, "abort")
    return done, eng.get_metrics()


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("blocks", [256, 18])  # 18 blocks of 4 tokens: preemptions
def test_async_outputs_equal_sync(model, k, blocks) -> None:
    path, cfg = model
    prompts = mixed_prompts(7, cfg.vocab_size, seed=k + blocks)
    results, pending_rows = [], []
    for on in (False, True):
        with _llm(path, k, on, blocks) as llm:
            runner = llm.llm_engine.executor.runner
            fill, seen = runner._fill_pending_drafts, [0]

            def spy(step, inp, fill=fill, seen=seen):
                seen[0] += sum(1 for s in step.seqs[:inp.num_decodes] if s.input_token_ids[1] < 0)
                return fill(step, inp)

            runner._fill_pending_drafts = spy
            fill_tok, seen_tok = runner._fill_pending_tokens, [0]

            def spy_tok(step, inp, fill=fill_tok, seen=seen_tok):
                seen[0] += sum(1 for s in step.seqs if not s.is_prefill and s.input_token_ids[0] < 0)
                return fill(step, inp)

            runner._fill_pending_tokens = spy_tok
            results.append(_run(llm, prompts, cfg.vocab_size, abort_at=4))
            pending_rows.append((seen[0], seen_tok[0]))
    (sync, ms), (asyn, ma) = results
    assert len(sync) == len(prompts) and sync["3"][1] == "abort"
    lag = 0
    if k == 0:  # the step in flight when "3" is aborted never applies its token for it (one-step lag)
        lag = len(sync["3"][0]) - len(asyn["3"][0])
        assert lag in (0, 1) and asyn["3"] == (sync["3"][0][:len(asyn["3"][0])], "abort")
        asyn = {**asyn, "3": sync["3"]}
    assert asyn == sync
    assert ma["num_output_tokens"] == ms["num_output_tokens"] - lag
    assert ma["num_preemptions"] == ms["num_preemptions"]
    if k == 0:  # a request admitted into a slot freed by the step in flight starts one step later
        assert ms["num_steps"] <= ma["num_steps"] <= ms["num_steps"] + len(prompts)
    else:
        assert ma["num_steps"] == ms["num_steps"]
    if blocks == 18:
        assert ms["num_preemptions"] > 0
    # async: decodes read the drafts (k > 0) or their newest token (k = 0: scheduled a step ahead)
    # the ranks computed, none reaching the host first; sync: never
    assert pending_rows[0] == (0, 0) and (pending_rows[1][0] > 0) == (k > 0) and (pending_rows[1][1] > 0) == (k == 0)


def test_a_step_returns_before_its_drafts_are_read(model, monkeypatch) -> None:
    """With async scheduling the engine reads a step's tokens, returns, and takes its drafts at
    the start of the next step; without it, inside the same step."""
    path, cfg = model
    for on in (True, False):
        with _llm(path, 2, on) as llm:
            eng, log = llm.llm_engine, []
            real = eng.executor.execute_async

            def spy(step_input, real=real, log=log):
                handle = real(step_input)
                out, drafts = handle.output, handle.drafts
                handle.output = lambda: (log.append("output"), out())[1]
                handle.drafts = lambda: (log.append("drafts"), drafts())[1]
                return handle

            monkeypatch.setattr(eng.executor, "execute_async", spy)
            eng.add_request({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0.0, max_tokens=8,
                                                                               ignore_eos=True))
            eng.step()
            assert log == (["output"] if on else ["output", "drafts"])
            eng.step()
            assert log == (["output", "drafts", "output"] if on else ["output", "drafts"] * 2)
            while eng.has_unfinished_requests():
                eng.step()


def test_staging_returns_each_array_with_its_dtype_and_shape() -> None:
    import numpy as np
    import torch

    from mtpspec.engine.staging import Staging
    st = Staging(torch.device("cpu"))
    arrays = [(np.arange(6).reshape(2, 3), torch.int32), ([1.5, -2.0], torch.float64), (np.zeros((0, 4)), torch.int64),
              (np.array([2 ** 40]), torch.int64), (np.float32([0.25]), torch.float32), (np.int64(5), torch.int64)]
    idx = [st.add(a, dt) for a, dt in arrays]
    out = st.flush()
    for i, (a, dt) in zip(idx, arrays):
        assert out[i].dtype == dt and out[i].shape == torch.Size(np.asarray(a).shape)
        assert torch.equal(out[i], torch.as_tensor(np.asarray(a)).to(dt))
    with pytest.raises(TypeError, match="dtype must be one of"):
        st.add([1], torch.bool)


def test_k0_step_ahead_leaves_nothing_behind_and_ids_stay_unique(model) -> None:
    """k = 0 step ahead: a step holding only rows of requests that just finished is dropped, not
    left in flight (the next generate's metrics count only its own steps); a failing step leaves
    nothing in flight (a dead engine must not look busy); two live requests cannot share an id
    (the ranks find each one's pending token by id)."""
    from mtpspec.engine.executor import WorkerError
    path, cfg = model
    with _llm(path, 0, True) as llm:
        eng = llm.llm_engine
        llm.generate(token_prompts(mixed_prompts(6, 200, seed=61)),
                     [SamplingParams(temperature=1.0, seed=i, max_tokens=40, stop_token_ids=[3, 4, 5, 6, 7, 8, 9])
                      for i in range(6)], use_tqdm=False)
        assert eng._inflight is None and not eng.has_unfinished_requests()
        llm.reset_metrics()
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                     use_tqdm=False)
        assert eng.get_metrics()["num_steps"] == 3 and eng._inflight is None
        eng.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4), request_id="x")
        with pytest.raises(ValueError, match="'x' is already in use"):
            eng.add_request({"prompt_token_ids": [8, 9]}, SamplingParams(max_tokens=4), request_id="x")
        eng.add_request({"prompt_token_ids": [8]}, SamplingParams(max_tokens=4), request_id="0_y")
        with pytest.raises(ValueError, match="'0_y' is already in use"):  # child 0 of "y" would be "0_y"
            eng.add_request({"prompt_token_ids": [8]}, SamplingParams(temperature=1.0, max_tokens=4, n=2),
                            request_id="y")
        eng.step()
        eng.step()
        assert eng._inflight is not None  # a decode one position ahead
        real = eng.executor.execute_async

        def failing(step):
            handle = real(step)
            handle.output = lambda: (_ for _ in ()).throw(WorkerError("rank 1 died"))
            return handle
        eng.executor.execute_async = failing
        with pytest.raises(WorkerError):
            eng.step()
            eng.step()
        assert eng._inflight is None

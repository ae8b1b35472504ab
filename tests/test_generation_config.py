"""``generation_config.json`` as vLLM reads it (``--generation-config auto | vllm | FOLDER``): every EOS
id ends a request (whatever the setting); the temperature / top_p / top_k / repetition_penalty /
max_new_tokens it sets become the defaults of requests that leave them unset (not under ``vllm``)."""

from __future__ import annotations

import json
import logging
import os

import pytest

from test_engine_fixtures import make_model

from mtpspec import LLM, SamplingParams
from mtpspec.engine.generation_config import (default_sampling_fields, generation_eos_token_ids,
                                              load_generation_config)


def test_reading_the_file(tmp_path, caplog):
    assert load_generation_config(str(tmp_path)) == {} and load_generation_config(str(tmp_path), "vllm") == {}
    with pytest.raises(ValueError, match="--generation-config .*expected 'auto', 'vllm' or a folder"):
        load_generation_config(str(tmp_path), str(tmp_path / "nowhere"))
    f = tmp_path / "generation_config.json"
    f.write_text('{"eos_token_id": [3, 7], "temperature": 0.6, "top_p": 0.95, "top_k": 50, "max_new_tokens": 64, '
                 '"do_sample": true, "min_p": 0.05, "repetition_penalty": 1.0}')
    gen = load_generation_config(str(tmp_path))
    assert load_generation_config("/elsewhere", str(tmp_path)) == gen
    assert load_generation_config(str(tmp_path), "vllm") == gen  # its EOS ids still count (vLLM)
    assert generation_eos_token_ids(gen) == {3, 7}
    assert default_sampling_fields(gen, "vllm") == {}
    with caplog.at_level(logging.WARNING):
        # what the file sets, also values equal to transformers 4's defaults (transformers 5's to_diff_dict keeps them)
        assert default_sampling_fields(gen) == {"temperature": 0.6, "top_p": 0.95, "top_k": 50, "max_tokens": 64,
                                                "repetition_penalty": 1.0}
    assert "min_p" in caplog.text and "does not implement" in caplog.text
    for v, want in ((5, {5}), (None, set()), ([], set())):
        assert generation_eos_token_ids({"eos_token_id": v}) == want
    for bad in ("2", [1, "2"], -1, [True]):
        with pytest.raises(ValueError, match="eos_token_id must be an id >= 0 or a list"):
            generation_eos_token_ids({"eos_token_id": bad})
    for text in ("{oops", "[1, 2]"):
        f.write_text(text)
        with pytest.raises(ValueError, match="generation_config.json: "):
            load_generation_config(str(tmp_path))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gen_cfg"))
    make_model(path, seed=5)
    return path


def test_eos_ids_and_defaults_reach_llm(model):
    prompt = {"prompt_token_ids": [5, 9, 11, 4]}
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=False)
    llm = LLM(model, device="cpu", speculative_config=None)
    try:
        ref = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    assert len(ref) == 10
    stop_at = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    path = os.path.join(model, "generation_config.json")
    with open(path, "w") as f:
        json.dump({"eos_token_id": [ref[stop_at], 10 ** 6], "temperature": 0.0, "max_new_tokens": 2}, f)
    try:
        llm = LLM(model, device="cpu", speculative_config={"num_speculative_tokens": 2})
        try:
            d = llm.get_default_sampling_params()
            assert (d.temperature, d.max_tokens) == (0.0, 2)
            out = llm.generate(prompt, use_tqdm=False)[0].outputs[0]  # the file's defaults: greedy, 2 tokens
            assert out.token_ids == ref[:2] and out.finish_reason == "length"
            out = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]  # its EOS id ends the request
            assert out.token_ids == ref[:stop_at + 1] and out.finish_reason == "stop"
            out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
            assert out.token_ids == ref
        finally:
            llm.shutdown()
        llm = LLM(model, device="cpu", speculative_config=None, generation_config="vllm")  # EOS ids only
        try:
            assert llm.get_default_sampling_params().temperature == 1.0
            assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == ref[:stop_at + 1]
        finally:
            llm.shutdown()
        with open(path, "w") as f:
            json.dump({"temperature": -1.0}, f)
        with pytest.raises(ValueError, match="generation_config.json of .*temperature.*--generation-config vllm"):
            LLM(model, device="cpu", speculative_config=None)
    finally:
        os.remove(path)


def test_server_requests_take_the_defaults_for_fields_they_leave_unset():
    from mtpspec.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
    from mtpspec.entrypoints.openai_server import _sampling_params
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 33}
    p = _sampling_params(CompletionRequest(prompt="x"), None, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.6, 0.9, 20, 1.1, 33)
    req = CompletionRequest(prompt="x", temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0, max_tokens=5)
    p = _sampling_params(req, req.max_tokens, defaults=defaults)  # what the request sets wins
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.0, 1.0, 0, 1.0, 5)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    p = _sampling_params(chat, None, defaults=defaults)
    assert (p.temperature, p.max_tokens) == (0.6, 33)
    assert _sampling_params(CompletionRequest(prompt="x", max_tokens=50), 50, defaults=defaults).max_tokens == 33
    # (the file's max_new_tokens caps what a request asks, as vLLM's get_max_tokens)
    p = _sampling_params(CompletionRequest(prompt="x"), None)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (1.0, 1.0, 0, 1.0, None)

"""Context-length rules as in vLLM.

Server: prompt + ``max_tokens`` above ``max_model_len`` is a 400 with vLLM's message, and one
refused request never disturbs the others (in process: ASGI transport, no port). Offline
``LLM.generate``: a prompt with no room for one token raises; prompt + ``max_tokens`` beyond the
context stops there with ``finish_reason == "length"``.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from test_engine_fixtures import make_model

MAX_LEN = 48


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("tiny_ctx"))
    make_model(p, seed=21)
    return p


@pytest.fixture(scope="module")
def app_engine(path):
    from mtpspec.engine.async_llm import AsyncLLM
    from mtpspec.entrypoints.openai_server import ServerContext, build_app
    from mtpspec.entrypoints.server_metrics import ServerMetrics

    engine = AsyncLLM.from_model(path, device="cpu", max_model_len=MAX_LEN, block_size=4, num_kv_blocks=128,
                                 max_num_seqs=4, seed=0, speculative_config={"num_speculative_tokens": 2})
    try:
        ctx = ServerContext(engine, "tiny", path, {}, ServerMetrics(engine.num_speculative_tokens, {}))
        yield build_app(ctx), engine
    finally:
        engine.shutdown()


def _words(n: int, start: int = 5) -> str:
    return " ".join(f"w{start + i % 100}" for i in range(n))


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)


def _run(coro):
    return asyncio.run(coro)


def _vllm_message(p: int, t: int) -> str:
    return (f"This model's maximum context length is {MAX_LEN} tokens. However, you requested {p + t} tokens "
            f"({p} in the messages, {t} in the completion). Please reduce the length of the messages or completion.")


def test_prompt_plus_max_tokens_over_context_is_400(app_engine) -> None:
    app, engine = app_engine

    async def main():
        async with _client(app) as c:
            base = {"temperature": 0, "ignore_eos": True}
            r = await c.post("/v1/completions", json=dict(base, prompt=_words(40), max_tokens=9))
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["message"] == _vllm_message(40, 9) and err["param"] == "max_tokens" and err["code"] == 400
            # exactly at the limit: served, stops at max_tokens == the end of the context
            r = await c.post("/v1/completions", json=dict(base, prompt=_words(40), max_tokens=8, return_token_ids=True))
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            assert len(ch["token_ids"]) == 8 and ch["finish_reason"] == "length"
            # max_tokens null: up to the context, never an error
            r = await c.post("/v1/completions", json=dict(base, prompt=_words(45), max_tokens=None, return_token_ids=True))
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            assert len(ch["token_ids"]) == 3 and ch["finish_reason"] == "length"
            # a list of prompts: the offending one is named, nothing runs
            steps = await engine.call_in_engine(lambda e: e.metrics.num_steps)
            r = await c.post("/v1/completions", json=dict(base, prompt=[_words(3), _words(30)], max_tokens=20))
            assert r.status_code == 400 and r.json()["error"]["message"] == "prompt 1: " + _vllm_message(30, 20)
            assert await engine.call_in_engine(lambda e: e.metrics.num_steps) == steps
            # streaming is refused the same way, before any event
            r = await c.post("/v1/completions", json=dict(base, prompt=_words(40), max_tokens=20, stream=True))
            assert r.status_code == 400 and r.json()["error"]["message"] == _vllm_message(40, 20)
            # chat: max_completion_tokens (or max_tokens) over the rest of the context
            msgs = [{"role": "user", "content": _words(30)}]
            r = await c.post("/v1/chat/completions", json=dict(base, messages=msgs, max_completion_tokens=40))
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "max_completion_tokens"
            m = re.search(r"you requested (\d+) tokens \((\d+) in the messages", err["message"])
            assert m and err["message"] == _vllm_message(int(m.group(2)), 40), err["message"]
            assert int(m.group(2)) + 40 > MAX_LEN
            r = await c.post("/v1/chat/completions", json=dict(base, messages=msgs, max_tokens=40))
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
            r = await c.post("/v1/chat/completions", json=dict(base, messages=msgs, max_tokens=2))
            assert r.status_code == 200, r.text

    _run(main())


def test_bad_request_does_not_disturb_a_concurrent_good_one(app_engine) -> None:
    app, engine = app_engine
    good = {"prompt": _words(4, 10), "max_tokens": 30, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    async def main():
        async with _client(app) as c:
            alone = (await c.post("/v1/completions", json=good)).json()["choices"][0]["token_ids"]
            assert len(alone) == 30

            async def bad(i):
                await asyncio.sleep(0.01 * i)
                return await c.post("/v1/completions", json={"prompt": _words(40), "max_tokens": 10 + i})

            async def streamed_good():
                toks = []
                async with c.stream("POST", "/v1/completions", json=dict(good, stream=True)) as s:
                    assert s.status_code == 200
                    async for line in s.aiter_lines():
                        if line.startswith("data: {"):
                            import json
                            toks.append(json.loads(line[6:])["choices"])
                return toks

            res = await asyncio.gather(c.post("/v1/completions", json=good), streamed_good(),
                                       *(bad(i) for i in range(6)))
            plain, streamed, bads = res[0], res[1], res[2:]
            assert plain.status_code == 200 and plain.json()["choices"][0]["token_ids"] == alone
            assert streamed and streamed[-1][0]["finish_reason"] == "length"
            assert all(b.status_code == 400 and "maximum context length" in b.json()["error"]["message"] for b in bads)
            assert (await c.get("/health")).status_code == 200
            s = engine.stats()
            assert s.num_running == 0 and s.num_free_blocks == s.num_total_blocks

    _run(main())


@pytest.mark.parametrize("k", [0, 2])
def test_offline_generate_context_rules(path, k) -> None:
    """Offline ``LLM.generate`` (vLLM's offline rules): a prompt that leaves no room for one token
    raises before any work; prompt + ``max_tokens`` beyond ``max_model_len`` is not an error and
    stops at the end of the context with ``finish_reason == "length"`` (also mid-block at k > 0)."""
    from mtpspec import LLM, SamplingParams

    spec = {"num_speculative_tokens": k} if k else None
    with LLM(path, speculative_config=spec, device="cpu", max_model_len=MAX_LEN, block_size=4, num_kv_blocks=128,
             seed=0) as llm:
        with pytest.raises(ValueError, match="prompt 0: This model.s maximum context length is 48 tokens. However, your "
                                             "request has 48 input tokens"):
            llm.generate([{"prompt_token_ids": [5] * MAX_LEN}], use_tqdm=False)
        for n, max_tokens in ((47, 5), (40, 30), (30, None), (3, 10_000)):
            for params in (SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                           SamplingParams(temperature=0.8, seed=n, max_tokens=max_tokens, ignore_eos=True)):
                out = llm.generate([{"prompt_token_ids": [7 + i % 50 for i in range(n)]}], params,
                                   use_tqdm=False)[0].outputs[0]
                want = MAX_LEN - n if max_tokens is None else min(max_tokens, MAX_LEN - n)
                assert len(out.token_ids) == want and out.finish_reason == "length", (n, max_tokens)

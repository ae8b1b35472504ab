"""``AsyncLLM`` in process: streams, early exit aborts, queue limit, calls between steps."""

from __future__ import annotations

import asyncio
import time

import pytest

from test_server_fixtures import make_served_model

from mtpspec import LLM, SamplingParams
from mtpspec.engine.async_llm import AsyncLLM, QueueFullError

SPEC = {"method": "mtp", "num_speculative_tokens": 2, "use_local_argmax_reduction": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("async_model"))
    make_served_model(path, seed=9)
    return path


def test_streams_equal_offline_and_early_exit_aborts(model_dir):
    prompts = ["Question: Ann has 4 cats.", "Numbers:", "The farmer"]
    params = SamplingParams(temperature=0, max_tokens=20)
    ref = LLM(model_dir, device="cpu", max_model_len=256, speculative_config=SPEC)
    try:
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    finally:
        ref.shutdown()
    eng = AsyncLLM.from_model(model_dir, max_queue_len=2, device="cpu", max_model_len=256, max_num_seqs=4,
                              speculative_config=SPEC)
    try:
        async def collect(p):
            seen = []
            async for out in eng.generate(p, params):
                seen.append(list(out.outputs[0].token_ids))
            assert all(a == b[:len(a)] for a, b in zip(seen, seen[1:]))  # cumulative and growing
            return seen[-1], out

        async def main():
            return await asyncio.gather(*(collect(p) for p in prompts[:2]))

        results = asyncio.run(main())
        assert [r[0] for r in results] == want[:2] and all(r[1].finished for r in results)

        async def leave_early():
            n = 0
            async for out in eng.generate("Long:", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)):
                n += 1
                if n == 2:
                    break
            return out

        out = asyncio.run(leave_early())
        assert not out.finished
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            s = eng.stats()
            if s.num_running == 0 and s.num_free_blocks == s.num_total_blocks:
                break
            time.sleep(0.02)
        s = eng.stats()
        assert s.num_running == 0 and s.num_free_blocks == s.num_total_blocks and s.num_pending == 0

        async def queue_and_call():
            with pytest.raises(ValueError, match="empty"):
                eng.add_request("", params)
            streams = [eng.add_request("x", params), eng.add_request("y", params)]
            try:
                if eng.stats().num_pending >= 2:  # nothing scheduled yet: the third is refused
                    with pytest.raises(QueueFullError):
                        eng.add_request("z", params)
                steps = await eng.call_in_engine(lambda e: e.metrics.num_steps)
                assert isinstance(steps, int) and steps > 0
            finally:
                for st in streams:
                    st.abort()

        asyncio.run(queue_and_call())
    finally:
        eng.shutdown()

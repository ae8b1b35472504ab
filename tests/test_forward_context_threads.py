"""The forward context is per thread: engines of one process (an ``AsyncLLM``'s engine thread, an
``LLM`` in the caller's thread) never see, or restore on exit, another thread's attention metadata.

Found by the full suite (2026-12-06): with one process-wide slot, two engines stepping at once in
``test_server_request_path`` interleaved their ``set_forward_context`` blocks, and the one that exited
last restored the other's metadata, so later training tests in the same process, which run without a
context, found a 16-token KV-cache layout ("attention metadata covers 16 tokens but the batch has 1
rows").
"""

from __future__ import annotations

import threading

from mtpspec import LLM, SamplingParams, demo_model_path
from mtpspec.layers.attention import build_attention_metadata, get_forward_context, set_forward_context


def test_interleaved_blocks_of_two_threads_see_and_restore_their_own() -> None:
    """a enters, b enters, a leaves, b leaves: each sees its own metadata inside and none after
    (a process-wide slot gives a b's inside, and b restores a's on its way out)."""
    metas = {name: build_attention_metadata([n], [n]) for name, n in (("a", 3), ("b", 5))}
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a() -> None:
        with set_forward_context(metas["a"]):
            a_in.set()
            b_in.wait(30)
            seen["a", "inside"] = get_forward_context().attn_metadata
        a_out.set()
        seen["a", "after"] = get_forward_context().attn_metadata

    def b() -> None:
        a_in.wait(30)
        with set_forward_context(metas["b"]):
            b_in.set()
            seen["b", "inside"] = get_forward_context().attn_metadata
            a_out.wait(30)
        seen["b", "after"] = get_forward_context().attn_metadata

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert seen["a", "inside"] is metas["a"] and seen["b", "inside"] is metas["b"]
    assert seen["a", "after"] is None and seen["b", "after"] is None
    assert get_forward_context().attn_metadata is None  # the main thread never entered one


def test_two_engines_stepping_in_two_threads_give_their_alone_outputs() -> None:
    """Two demo engines (k = 3 and plain) decode at once in two threads: each gives the tokens it
    gives alone, and no metadata is left behind in any thread."""
    prompts = [f"Question: What is {i} + {2 * i}?\nAnswer:" for i in range(6)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(device="cpu", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32)
    engines = [LLM(demo_model_path(), **kw, speculative_config={"method": "mtp", "num_speculative_tokens": 3}),
               LLM(demo_model_path(), **kw, speculative_config=None)]
    try:
        alone = [[o.outputs[0].token_ids for o in e.generate(prompts, sp, use_tqdm=False)] for e in engines]
        assert alone[0] == alone[1]  # greedy speculative decoding == greedy decoding
        got, errors = [None, None], []
        start = threading.Barrier(2)

        def run(i: int) -> None:
            try:
                start.wait()
                got[i] = [[o.outputs[0].token_ids for o in engines[i].generate(prompts, sp, use_tqdm=False)]
                          for _ in range(3)]
                got[i].append(get_forward_context().attn_metadata)
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        for i in range(2):
            assert got[i][:3] == [alone[i]] * 3 and got[i][3] is None
        assert get_forward_context().attn_metadata is None
    finally:
        for e in engines:
            e.shutdown()

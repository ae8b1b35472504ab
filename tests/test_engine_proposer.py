"""The MTP proposer's drafts equal an independent no-cache reference, step after step.

Reference for a sequence holding tokens ``t_0 .. t_{n-1}`` (the last one not yet fed to the
target): the target's full forward over ``t_0 .. t_{n-2}`` gives hidden states ``h_i``; MTP
step 0 is a full causal forward over rows ``i = 0 .. n-2`` with input id ``t_{i+1}`` and hidden
``h_i`` at position ``i``, its last row giving draft 1; step ``j`` appends one row per earlier
draft (input id = that draft, hidden = the previous step's last output, position
``n - 2 + m``) and runs the whole thing again with ``spec_step_idx = j``. This catches shifted
ids, a wrong hidden state, a wrong position, a wrong ``spec_step_idx`` and an MTP KV cache that
was not filled (or was filled at the wrong slots), none of which break losslessness.
"""

from __future__ import annotations

from typing import List

import pytest
import torch

from test_engine_fixtures import OracleDrafts, make_model, mixed_prompts, token_prompts

from mtpspec import LLM, SamplingParams
from mtpspec.models.loader import load_models


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_proposer"))
    _, cfg = make_model(path, seed=5, num_mtp_layers=2)
    target, mtp = load_models(path, dtype="float32", device="cpu")
    return path, cfg, target, mtp


@torch.inference_mode()
def reference_drafts(target, mtp, tokens: List[int], k: int, local_argmax: bool) -> tuple:
    """Drafts and, per step, the margin between the best and second-best logit."""
    n = len(tokens)
    ids = torch.tensor(tokens[:-1])
    h = target(ids, torch.arange(n - 1))
    mtp_ids = torch.tensor(tokens[1:])
    prev = h
    drafts, margins = [], []
    extra_ids: List[int] = []
    extra_h: List[torch.Tensor] = []
    for step in range(k):
        all_ids = torch.cat([mtp_ids, torch.tensor(extra_ids, dtype=torch.long)])
        all_h = torch.cat([prev] + extra_h) if extra_h else prev
        out = mtp(all_ids, torch.arange(all_ids.shape[0]), all_h, spec_step_idx=step)
        last = out[-1:]
        logits = mtp.compute_logits(last, spec_step_idx=step)[0]
        top2 = logits.topk(2).values
        margins.append(float(top2[0] - top2[1]))
        d = int(mtp.get_top_tokens(last, spec_step_idx=step)[0]) if local_argmax else int(logits.argmax())
        drafts.append(d)
        extra_ids.append(d)
        extra_h.append(last)
    return drafts, margins


@pytest.mark.parametrize("k,local_argmax", [(1, True), (3, False), (4, True)])
def test_drafts_match_no_cache_reference(model, k: int, local_argmax: bool) -> None:
    path, cfg, target, mtp = model
    prompts = mixed_prompts(5, cfg.vocab_size, seed=9)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(path, max_model_len=64, block_size=4, num_kv_blocks=128, max_num_seqs=3, seed=0) as plain:
        longer = plain.generate(token_prompts(prompts), SamplingParams(temperature=0.0, max_tokens=24,
                                                                       ignore_eos=True), use_tqdm=False)
    oracle = OracleDrafts({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, longer)}, cfg.vocab_size, 0.4)
    seen = []

    def hook(seq, proposed):
        seen.append((list(seq.all_token_ids), list(proposed)))
        return oracle(seq, proposed)  # varied acceptance, so the first pass covers 1 .. k + 1 rows

    with LLM(path, max_model_len=64, block_size=4, num_kv_blocks=128, max_num_seqs=3, seed=0,
             speculative_config={"num_speculative_tokens": k, "use_local_argmax_reduction": local_argmax}) as llm:
        llm.llm_engine.draft_hook = hook
        llm.generate(token_prompts(prompts), sp, use_tqdm=False)
    assert len(seen) > 20
    accepted_lengths = set()
    prev_len = {}
    checked = 0
    for tokens, proposed in seen:
        want, margins = reference_drafts(target, mtp, tokens, k, local_argmax)
        for j, (a, b) in enumerate(zip(proposed, want)):
            if a != b:
                assert margins[j] < 1e-3, (tokens, proposed, want, margins)
                break  # later steps depend on this draft
            checked += 1
        key = tuple(tokens[:3])
        if key in prev_len:
            accepted_lengths.add(len(tokens) - prev_len[key] - 1)
        prev_len[key] = len(tokens)
    assert checked >= len(seen) * k * 0.9
    assert len(accepted_lengths) >= min(k + 1, 3), accepted_lengths


class _Recorder(torch.nn.Module):
    """Wraps an MTP model and records the spec_step_idx of every forward."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.steps: List[int] = []
        self.supports_local_argmax = True
        self.num_mtp_layers = inner.num_mtp_layers

    def forward(self, input_ids, positions, previous_hidden_states, spec_step_idx=0):
        self.steps.append(spec_step_idx)
        return self.inner(input_ids, positions, previous_hidden_states, spec_step_idx=spec_step_idx)

    def compute_logits(self, h, spec_step_idx=0):
        return self.inner.compute_logits(h, spec_step_idx=spec_step_idx)

    def get_top_tokens(self, h, spec_step_idx=0):
        return self.inner.get_top_tokens(h, spec_step_idx=spec_step_idx)


def test_every_draft_step_passes_its_index(model) -> None:
    """k = 5 with 2 MTP layers: the first pass runs layer 0 then fills layer 1's cache; draft
    step j runs spec_step_idx j (layer j % 2) and, except the last, fills the other layer."""
    path = model[0]
    with LLM(path, max_model_len=64, block_size=4, num_kv_blocks=64, max_num_seqs=2, seed=0,
             speculative_config={"num_speculative_tokens": 5}) as llm:
        prop = llm.executor.runner.proposer
        rec = _Recorder(prop.model)
        prop.model = rec
        llm.executor.runner.fwd.mtp_model = rec
        llm.generate(token_prompts([[5, 6, 7], [8]]), SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
        per_step = [0, 1, 1, 0, 2, 1, 3, 0, 4]  # first pass 0 + fill 1; steps 1..4 (+ fills but the last)
        assert rec.steps and len(rec.steps) % len(per_step) == 0
        assert rec.steps == per_step * (len(rec.steps) // len(per_step))
        assert [prop.model.inner.layer_index(s) for s in range(5)] == [0, 1, 0, 1, 0]


def test_lifecycle_hooks_bracket_the_two_phases(model) -> None:
    """At run time ``propose`` calls ``on_prefill_begin/end`` around the first pass (every used
    layer) and ``on_multi_step_decode_begin/end(B, k - 1)`` around the draft steps, once per step
    (``graph_mode="static"``: the graphed forward's path)."""
    path = model[0]
    k = 3
    with LLM(path, max_model_len=64, block_size=4, num_kv_blocks=64, max_num_seqs=2, seed=0, graph_mode="static",
             speculative_config={"num_speculative_tokens": k}) as llm:
        runner = llm.executor.runner
        prop, fwd, events = runner.proposer, runner.fwd, []
        prop.on_prefill_begin = lambda meta: events.append(("prefill_begin", meta.num_seqs))
        prop.on_prefill_end = lambda meta: events.append(("prefill_end", meta.num_seqs))
        prop.on_multi_step_decode_begin = lambda b, n: events.append(("decode_begin", b, n))
        prop.on_multi_step_decode_end = lambda b, n: events.append(("decode_end", b, n))
        first, first_top, step = fwd.mtp_first, fwd.mtp_first_top, fwd.mtp_step
        inside = []  # an eager mtp_first_top (prefill steps) makes its pass through mtp_first: one call

        def first_top_once(*a):
            events.append(("first",))
            inside.append(1)
            try:
                return first_top(*a)
            finally:
                inside.pop()

        def first_once(*a):
            if not inside:
                events.append(("first",))
            return first(*a)
        fwd.mtp_first, fwd.mtp_first_top = first_once, first_top_once
        fwd.mtp_step = lambda *a: events.append(("step",)) or step(*a)
        llm.generate(token_prompts([[5, 6, 7], [8]]), SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    # 2 MTP layers, k = 3: first pass on layers 0 (with the first draft) and 1; step 1 + its fill of
    # layer 0; step 2
    steps = 0
    while events:
        b = events[0][1]
        want = [("prefill_begin", b), ("first",), ("first",), ("prefill_end", b), ("decode_begin", b, k - 1),
                ("step",), ("step",), ("step",), ("decode_end", b, k - 1)]
        assert events[:len(want)] == want, events[:len(want)]
        del events[:len(want)]
        steps += 1
    assert steps >= 3


def test_graph_units_share_one_logits_buffer(model) -> None:
    """The graphed path's verify units write their logits into one buffer shared by every batch
    size and verify width (``GraphedForward.logits_out``; kept per unit in the CUDA-graph pool they
    took ~13 GB of an adaptive Air engine's graphs and left no room to capture them on an H100),
    and the tokens equal the eager engine's."""
    path = model[0]
    prompts = token_prompts([[5, 6, 7], [8], [9, 10]])
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    outs, seen = {}, []
    for mode in ("static", "off"):
        with LLM(path, max_model_len=64, block_size=4, num_kv_blocks=64, max_num_seqs=3, seed=0, graph_mode=mode,
                 speculative_config={"num_speculative_tokens": 2}) as llm:
            fwd = llm.executor.runner.fwd
            if mode == "static":
                buf = fwd.logits_out
                assert buf is not None and buf.shape[0] >= 3 * (1 + 2)
                verify = fwd.verify

                def spy(*a, **kw):
                    hidden, logits = verify(*a, **kw)
                    if fwd.active is not None:  # a step through the static units
                        seen.append(logits.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr())
                    return hidden, logits
                fwd.verify = spy
            outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert seen and all(seen)
    assert outs["static"] == outs["off"]


def test_a_failed_capture_names_its_unit_and_how_many_were_captured(model) -> None:
    """``capture_failed`` says which unit's capture raised and how many units were captured before it
    (the H100's out-of-memory capture could not be placed, 2026-12-05); a failure between units says
    so; every graph is dropped (decode steps run eagerly). The capture is driven on the CPU with a
    stand-in for the CUDA-graph call."""
    path = model[0]
    with LLM(path, max_model_len=64, block_size=4, num_kv_blocks=64, max_num_seqs=3, seed=0, graph_mode="static",
             speculative_config={"num_speculative_tokens": 2}) as llm:
        runner = llm.executor.runner
        fwd, calls = runner.fwd, []

        def capture_one(fn, meta):
            calls.append(fwd._capturing)
            if len(calls) == 3:
                raise RuntimeError("CUDA out of memory. Tried to allocate 74.00 MiB\nmore text")
            return None, None
        fwd.mode, fwd._capture_one = "cuda", capture_one
        fwd.capture(runner.proposer)
        assert fwd.graphs == {} and fwd._capturing == calls[2]
        assert fwd.capture_failed.startswith(f"CUDA graph capture failed at unit {calls[2]} after 2 units "
                                             "(RuntimeError: CUDA out of memory. Tried to allocate 74.00 MiB)")
        assert "--gpu-memory-utilization" in fwd.capture_failed and "more text" not in fwd.capture_failed
        calls.clear()
        fwd.dummy_layout, fwd.capture_failed = lambda *a: (_ for _ in ()).throw(RuntimeError("boom")), None
        fwd.capture(runner.proposer)
        assert fwd.capture_failed.startswith("CUDA graph capture failed between units after 0 units (RuntimeError: boom)")
        fwd.mode = "static"

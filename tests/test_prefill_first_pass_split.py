"""The MTP first pass of a step with prefill chunks runs on fewer rows: a prefill's rows before its
last get only their KV entries (the KV-only pass), the full pass runs on the decodes' rows and each
prefill's last row (``MTPProposer._split_prefill_rows``). Contract: the drafts equal those of the
full first pass over every row, token for token (float32, CPU), for GLM-4.5 with two MTP layers
(mixed steps, chunked prefill, prefix-cache hits), DeepSeek-V3 (dense MLA) and GLM-5 (DSA indexer keys, index
sharing); and
the split does run (KV-only rows counted), and not below its row threshold.
"""

from __future__ import annotations

import pytest

from test_engine_fixtures import make_model, mixed_prompts, token_prompts

import mtpspec.spec_decode.mtp_proposer as mtp_proposer
from mtpspec import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def _drafts(path, prompts, min_rows, monkeypatch, spec=None, **kw):
    monkeypatch.setattr(mtp_proposer, "PREFILL_KV_ONLY_MIN_ROWS", min_rows)
    kw = {"max_model_len": 64, "block_size": 4, "max_num_seqs": 3, "seed": 0, "num_kv_blocks": 256,
          "graph_mode": "off", "device": "cpu", **kw}  # CPU: float32 GEMMs whose bits do not depend on the row count
    drafts, split_rows = {}, []
    with LLM(path, speculative_config={"num_speculative_tokens": 3, **(spec or {})}, **kw) as llm:
        eng = llm.llm_engine
        proposer = eng.executor.runner.proposer
        write = proposer.write_kv_rows
        proposer.write_kv_rows = lambda ids, *a, **k: (split_rows.append(ids.shape[0]), write(ids, *a, **k))[1]

        def hook(seq, d):
            drafts[(seq.request_id, len(seq.output_token_ids))] = tuple(d)
            return d
        eng.draft_hook = hook
        outs = llm.generate(token_prompts(prompts), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                            use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], drafts, split_rows


@pytest.mark.parametrize("family,case", [("glm4_moe", "mixed"), ("glm4_moe", "chunked"), ("glm4_moe", "prefix"),
                                         ("deepseek_v3", "mixed"), ("glm_moe_dsa", "mixed")])
def test_split_first_pass_gives_the_drafts_of_the_full_first_pass(tmp_path, monkeypatch, family, case) -> None:
    path = str(tmp_path / "m")
    _, cfg = make_model(path, seed=5, family=family, **({"num_mtp_layers": 2} if family == "glm4_moe" else {}))
    prompts = mixed_prompts(7, cfg.vocab_size, seed=12)
    spec, kw = {}, {}
    if family == "glm_moe_dsa":
        spec["index_share_for_mtp_iteration"] = True
    if case == "chunked":
        kw.update(max_num_batched_tokens=13, enable_chunked_prefill=True)
    if case == "prefix":
        prompts = [prompts[1][:14] + p[:4] for p in prompts[2:]] + [prompts[1]]
    toks, got, rows = _drafts(path, prompts, 1, monkeypatch, spec, **kw)
    want_toks, want, none = _drafts(path, prompts, 10 ** 9, monkeypatch, spec, **kw)
    assert toks == want_toks and none == [] and sum(rows) > 0
    assert got == want and len(got) >= 20


def test_split_waits_for_its_row_threshold(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "m")
    _, cfg = make_model(path, seed=5)
    prompts = [[5] * 9, [7] * 3]  # one step: 8 + 2 rows could move
    assert _drafts(path, prompts, 11, monkeypatch)[2] == []
    assert _drafts(path, prompts, 10, monkeypatch)[2] == [10]


def test_split_first_pass_with_the_triton_kernels_under_the_interpreter(tmp_path, monkeypatch, interp) -> None:
    """DeepSeek-V3 (dense MLA): the reduced full pass mixes decode rows with one row per prefill; the
    Triton MLA kernel (the interpreter runs it) reads each kept row's whole causal range."""
    path = str(tmp_path / "m")
    _, cfg = make_model(path, seed=5, family="deepseek_v3")
    prompts = mixed_prompts(4, cfg.vocab_size, seed=12)
    toks, got, rows = _drafts(path, prompts, 1, monkeypatch)
    want_toks, want, _ = _drafts(path, prompts, 10 ** 9, monkeypatch)
    assert toks == want_toks and sum(rows) > 0 and got == want and len(got) >= 10

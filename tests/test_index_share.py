"""MTP index sharing (``index_share_for_mtp_iteration``, mtpspec/spec_decode/index_share.py).

The proposer is driven by hand over a tiny DeepSeek-V3.2 checkpoint (``index_topk`` 6, contexts
of 9 to 16 tokens: the selection prunes) through a prefill round and a decode round in which the
three requests accept 0, 3 and 1 of their 3 drafts. Its drafts are compared with an independent
full-recompute reference: a cache-less copy of the MTP model run over each request's whole
history, with the shared selection (the request's last accepted row's selection from the first
pass + the positions drafted since) given through ``precomputed_topk_pos``. The tests tell
apart the four known faults that other engines shipped in this path (the project's known-faults list, item 12): the MTP layer's own indexer
(never the target's), rows compacted per request with uneven accepted lengths, no
rejected-branch rows, the reuse engaging (scoring calls per round counted) and the anchor being
the first draft pass. Engine runs check losslessness with sharing on (eager, the graph code path,
tp 2).
"""

from __future__ import annotations

import pytest
import torch

from mtpspec.engine.input_prep import prepare_step
from mtpspec.engine.kv_cache import allocate, attention_layers
from mtpspec.layers.attention import build_attention_metadata, set_forward_context
from mtpspec.layers.indexer import DeepseekV32IndexerCache
from mtpspec.models.loader import load_models
from mtpspec.spec_decode.mtp_proposer import MTPProposer
from mtpspec.step_io import SeqInput, StepInput

K = 3
BS = 4
PROMPTS_LEN = (9, 12, 10)
ACCEPTED = (0, 3, 1)  # uneven: none, all, one


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from test_engine_fixtures import make_model
    path = str(tmp_path_factory.mktemp("dsv32_share"))
    _, cfg = make_model(path, seed=5, num_mtp_layers=1, family="deepseek_v32")
    return path, cfg


def _models(path):
    target, mtp = load_models(path, dtype=torch.float32, device="cpu")
    return target.eval(), mtp.eval()


class Driver:
    """A target + MTP pair with paged caches, a proposer, and the requests' token histories."""

    def __init__(self, path, cfg, share, k=K, prompts_len=PROMPTS_LEN, seed=0):
        self.target, self.mtp = _models(path)
        self.cfg, self.k = cfg, k
        allocate(attention_layers(self.target, self.mtp), 96, BS, torch.float32, torch.device("cpu"))
        self.proposer = MTPProposer(self.mtp, k, False, BS, cfg.max_position_embeddings, index_share=share,
                                    max_num_seqs=4)
        g = torch.Generator().manual_seed(seed)
        self.hist = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in prompts_len]
        self.tables = [list(range(i * 24, (i + 1) * 24)) for i in range(len(prompts_len))]
        self.g = g
        self.rounds = []  # per round: (drafts [B, k], anchor positions per request)

    def _propose(self, seqs, last_offsets, new_tokens):
        inp = prepare_step(StepInput(seqs), self.k, BS, self.cfg.max_position_embeddings, torch.device("cpu"))
        with torch.no_grad(), set_forward_context(inp.attn_metadata):
            hidden = self.target(inp.input_ids, inp.positions)
        drafts = self.proposer.propose(inp, hidden, torch.tensor(new_tokens), torch.tensor(last_offsets),
                                       host_last_row_offsets=list(last_offsets))
        anchors = [s.start_position + a for s, a in zip(seqs, last_offsets)]
        self.rounds.append((drafts, anchors))
        return drafts

    def prefill(self):
        new = torch.randint(3, self.cfg.vocab_size, (len(self.hist),), generator=self.g).tolist()
        seqs = [SeqInput(h, 0, t, True) for h, t in zip(self.hist, self.tables)]
        drafts = self._propose(seqs, [len(h) - 1 for h in self.hist], new)
        for h, t in zip(self.hist, new):
            h.append(t)
        return drafts

    def decode(self, accepted):
        drafts_prev = self.rounds[-1][0]
        seqs, new = [], torch.randint(3, self.cfg.vocab_size, (len(self.hist),), generator=self.g).tolist()
        for i, h in enumerate(self.hist):
            seqs.append(SeqInput([h[-1]] + drafts_prev[i].tolist(), len(h) - 1, self.tables[i], False))
        drafts = self._propose(seqs, list(accepted), new)
        for i, (h, a) in enumerate(zip(self.hist, accepted)):
            h.extend(drafts_prev[i, :a].tolist() + [new[i]])
        return drafts


def reference_drafts(path, cfg, history, k, share):
    """Independent full recompute of one request's ``k`` drafts after ``history`` (positions
    ``0 .. p + 1``; the anchor is position ``p = len(history) - 2``). Cache-less models; the
    target's post-norm hidden states of positions ``0 .. p``; the MTP first pass over them; step
    ``j`` reruns the MTP layer over all rows with the drafts appended. ``share``: rows past the
    anchor attend the anchor's first-pass selection + positions ``p + 1 .. own``; else every row
    runs its own indexer. Returns ``(drafts, anchor selection)``."""
    target, mtp = _models(path)
    ids = torch.tensor(history)
    n = len(history) - 1  # rows 0 .. p
    p = n - 1
    width = cfg.index_topk + k - 1

    def meta(rows, sel=None):
        m = build_attention_metadata([rows], [rows], None, block_size=BS)
        m.precomputed_topk_pos = sel
        return m

    with torch.no_grad():
        with set_forward_context(meta(n)):
            t_hidden = target(ids[:n], torch.arange(n))
        mtp_ids, prev = ids[1:n + 1], t_hidden
        with set_forward_context(meta(n)):
            out = mtp(mtp_ids, torch.arange(n), prev)
        own = mtp.index_selection(0).clone()  # [n, index_topk]
        anchor = own[p].clone()
        drafts = [int(mtp.compute_logits(out[p:p + 1]).argmax(-1))]
        prev = torch.cat([prev, out[p:p + 1]])
        for j in range(1, k):
            rows = n + j
            ids_j = torch.cat([mtp_ids, torch.tensor(drafts)])
            sel = None
            if share:
                sel = torch.full((rows, width), -1, dtype=torch.int64)
                sel[:n, :cfg.index_topk] = own
                for i in range(1, j + 1):
                    sel[p + i, :cfg.index_topk] = anchor
                    sel[p + i, cfg.index_topk:cfg.index_topk + i] = torch.arange(p + 1, p + i + 1)
            with set_forward_context(meta(rows, sel)):
                out = mtp(ids_j, torch.arange(rows), prev)
            drafts.append(int(mtp.compute_logits(out[p + j:p + j + 1]).argmax(-1)))
            prev = torch.cat([prev, out[p + j:p + j + 1]])
    return drafts, anchor


def _positions(sel):
    return sorted(int(x) for x in sel if int(x) >= 0)


@pytest.mark.parametrize("share", [True, False], ids=["share", "no_share"])
def test_drafts_equal_the_full_recompute_reference(ckpt, share):
    # Uneven acceptance in one batch (0, 3, 1 of 3): each request's drafts follow ITS last accepted
    # row's selection; a compaction or rejected-row bug feeds a request another row's selection.
    path, cfg = ckpt
    d = Driver(path, cfg, share)
    d.prefill()
    hist_after_prefill = [list(h) for h in d.hist]
    d.decode(ACCEPTED)
    for r, hists in ((0, hist_after_prefill), (1, d.hist)):
        drafts, anchors = d.rounds[r]
        for i, h in enumerate(hists):
            want, anchor_sel = reference_drafts(path, cfg, h, K, share)
            assert drafts[i].tolist() == want, (r, i, share)
            assert anchors[i] == len(h) - 2
            if share and r == 1:  # the recorded anchor selection is the first pass's at the anchor row
                state = d.proposer.index_share[0]
                assert _positions(state.anchor_sel[i]) == _positions(anchor_sel)
                assert int(state.anchor_pos[i]) == anchors[i]


def test_sharing_changes_the_selection_here(ckpt):
    # Above index_topk the shared selection differs from what the step's own indexer picks (else
    # the tests above could not see a no-op reuse): the sharing reference's drafts differ from the
    # non-sharing one's for some request. (Its anchor selection always misses positions once the
    # context is above index_topk, so that alone would prove nothing.)
    path, cfg = ckpt
    d = Driver(path, cfg, share=True)
    d.prefill()
    d.decode(ACCEPTED)
    differs = 0
    for h in d.hist:
        p = len(h) - 2
        assert p + 1 > cfg.index_topk  # contexts prune
        on, anchor = reference_drafts(path, cfg, h, K, True)
        off, _ = reference_drafts(path, cfg, h, K, False)
        assert len(_positions(anchor)) < p + 1
        differs += on != off
    assert differs > 0


def _count_scoring(monkeypatch, mtp):
    calls = {"n": 0}
    mine = {id(m) for m in mtp.modules() if isinstance(m, DeepseekV32IndexerCache)}
    orig = DeepseekV32IndexerCache.forward

    def counting(self, *a, **kw):
        if id(self) in mine:
            calls["n"] += 1
        return orig(self, *a, **kw)
    monkeypatch.setattr(DeepseekV32IndexerCache, "forward", counting)
    return calls


@pytest.mark.parametrize("share,per_round", [(True, 1), (False, K)])
def test_indexer_scores_once_per_round_with_sharing(ckpt, monkeypatch, share, per_round):
    # The reuse engages: the MTP indexer scores once per round (first pass) with sharing, k times
    # without (SGLang #29654 was a silent no-op); the state counts the same.
    path, cfg = ckpt
    d = Driver(path, cfg, share)
    calls = _count_scoring(monkeypatch, d.mtp)
    d.prefill()
    assert calls["n"] == per_round
    d.decode(ACCEPTED)
    assert calls["n"] == 2 * per_round
    if share:
        assert d.proposer.index_share[0].num_scoring_calls == 2 and d.proposer.index_share[0].mode == "off"


def test_short_context_sharing_equals_no_sharing(ckpt):
    # context + k <= index_topk (6): the anchor selection holds every position, so sharing
    # selects exactly what each step's own indexer selects.
    path, cfg = ckpt
    outs = []
    for share in (True, False):
        d = Driver(path, cfg, share, prompts_len=(1, 2, 1), seed=3)
        d.prefill()
        d.decode((0, 0, 0))
        assert max(len(h) for h in d.hist) - 1 + K <= cfg.index_topk + 1
        outs.append([r[0].tolist() for r in d.rounds])
    assert outs[0] == outs[1]


def test_anchor_is_recorded_in_the_first_pass_not_a_draft_step(ckpt):
    # The anchor is the first draft pass's selection (SGLang #29787): after a round the recorded
    # rows equal the first pass's selection at the anchor rows, and the draft steps' selection
    # (read from the MTP layer) starts with them.
    path, cfg = ckpt
    d = Driver(path, cfg, share=True)
    d.prefill()
    state = d.proposer.index_share[0]
    first_pass = {}
    orig = state.record

    def spy(topk_pos, positions, num_seqs):
        first_pass["sel"] = topk_pos.clone()
        orig(topk_pos, positions, num_seqs)
    state.record = spy
    d.decode(ACCEPTED)
    starts = [len(h) - 1 - a - 1 for h, a in zip(d.hist, ACCEPTED)]  # position of each decode's first row
    rows = [i * (1 + K) + a for i, a in enumerate(ACCEPTED)]
    assert torch.equal(state.anchor_sel[:3], first_pass["sel"][rows])
    last_step = d.mtp.index_selection(K - 1)
    assert last_step.shape[1] == cfg.index_topk + K - 1
    assert torch.equal(last_step[:, :cfg.index_topk], state.anchor_sel[:3])
    for i, (s, a) in enumerate(zip(starts, ACCEPTED)):  # then the positions drafted since the anchor
        assert last_step[i, cfg.index_topk:].tolist() == [s + a + 1, s + a + 2]


def test_sharing_off_for_models_without_indexer(tmp_path):
    from test_engine_fixtures import make_model
    make_model(str(tmp_path), seed=1, num_mtp_layers=1, family="deepseek_v3")
    _, mtp = load_models(str(tmp_path), dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="has no indexer"):
        MTPProposer(mtp, 2, False, BS, 64, index_share=True)


# ------------------------------------------------------------------------------------------------ engine
@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    from test_deepseek_v32 import FAMILY, make_engine_model
    return make_engine_model(tmp_path_factory, FAMILY, 2, 11)


@pytest.fixture(scope="module")
def plain_greedy(engine_model):
    from test_deepseek_v32 import engine_generate, engine_llm
    with engine_llm(engine_model[0]) as llm:
        return engine_generate(llm, engine_model[3])


def _spec(k, share=True, local_argmax=True):
    return {"num_speculative_tokens": k, "use_local_argmax_reduction": local_argmax,
            "index_share_for_mtp_iteration": share}


@pytest.mark.parametrize("k", [1, 3])
def test_engine_lossless_with_sharing(engine_model, plain_greedy, k):
    from test_deepseek_v32 import engine_generate, engine_llm
    with engine_llm(engine_model[0], speculative_config=_spec(k)) as llm:
        assert llm.engine_config.speculative_config.index_share_for_mtp_iteration is True
        assert engine_generate(llm, engine_model[3]) == plain_greedy
        assert len(llm.executor.runner.proposer.index_share) == 2  # both MTP layers' own states


def test_engine_graph_path_with_sharing(engine_model, plain_greedy, monkeypatch):
    # graph_mode="static": every unit on the captured metadata under the no-host-sync guard, the
    # sharing modes set by the hooks exactly as around a capture.
    from test_deepseek_v32 import engine_generate, engine_llm
    from test_paged_attention import no_host_sync

    from mtpspec.engine.forward import GraphedForward
    from mtpspec.layers.vocab_parallel_embedding import VocabParallelEmbedding
    modes = []

    def guarded_run(self, key, fn, bp, step, rows=None):
        meta = self._meta(bp, host=False, step=step, rows=rows)
        with no_host_sync():
            out = fn(meta)
        modes.append((key[0], self_proposer[0].index_share[0].mode))
        return out

    self_proposer = []
    monkeypatch.setattr(GraphedForward, "_run", guarded_run)
    with engine_llm(engine_model[0], max_num_seqs=8, graph_mode="static", speculative_config=_spec(3)) as llm:
        runner = llm.executor.runner
        self_proposer.append(runner.proposer)
        for model in (runner.target, runner.mtp):
            for m in model.modules():
                if isinstance(m, VocabParallelEmbedding):
                    m.validate_ids = False
        assert engine_generate(llm, engine_model[3]) == plain_greedy
        assert llm.get_metrics()["num_eager_fallbacks"] == 0
    assert {m for u, m in modes if u in ("first", "firsttop")} == {"record"}
    assert any(u == "firsttop" for u, _ in modes)
    assert {m for u, m in modes if u == "step"} == {"reuse"}
    assert {m for u, m in modes if u == "verify"} == {"off"}


def test_engine_tp2_lossless_with_sharing(engine_model, plain_greedy):
    from test_deepseek_v32 import engine_generate, engine_llm
    with engine_llm(engine_model[0], speculative_config=_spec(3, local_argmax=True), tensor_parallel_size=2,
                    device="cpu", sequence_parallel=True) as llm:
        assert engine_generate(llm, engine_model[3]) == plain_greedy


def test_checkpoint_value_is_the_default_and_the_config_overrides(ckpt, tmp_path):
    # index_share_for_mtp_iteration: the checkpoint's config.json value unless the speculative
    # config gives one; null / absent in both: off.
    import json
    import shutil

    from mtpspec.engine.arg_utils import EngineArgs
    path, _ = ckpt
    spec = {"num_speculative_tokens": 2}
    assert EngineArgs(model=path, speculative_config=spec).create_engine_config() \
        .speculative_config.index_share_for_mtp_iteration is False
    on = str(tmp_path / "on")
    shutil.copytree(path, on)
    raw = json.load(open(f"{on}/config.json"))
    raw["index_share_for_mtp_iteration"] = True
    json.dump(raw, open(f"{on}/config.json", "w"))
    resolved = lambda s: EngineArgs(model=on, speculative_config=s).create_engine_config() \
        .speculative_config.index_share_for_mtp_iteration  # noqa: E731
    assert resolved(spec) is True
    assert resolved(dict(spec, index_share_for_mtp_iteration=False)) is False
    assert resolved('{"num_speculative_tokens": 2, "index_share_for_mtp_iteration": false}') is False

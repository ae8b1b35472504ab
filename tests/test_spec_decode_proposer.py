"""The proposer interface: layering (``spec_decode`` does not import ``engine``), the registry,
the graph units of the MTP proposer and the lifecycle hooks around graph capture."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from typing import List

import pytest
import torch

from test_engine_fixtures import repo_env

import mtpspec.spec_decode
from mtpspec.config import SpeculativeConfig
from mtpspec.spec_decode.mtp_proposer import MTPProposer
from mtpspec.spec_decode.proposer import GraphUnits, Proposer, build_proposer, get_proposer_cls

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_spec_decode_modules_do_not_import_engine() -> None:
    names = sorted(m.name for m in pkgutil.iter_modules(mtpspec.spec_decode.__path__, "mtpspec.spec_decode."))
    assert {"mtpspec.spec_decode.proposer", "mtpspec.spec_decode.mtp_proposer"} <= set(names), names
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "from mtpspec.spec_decode.proposer import get_proposer_cls\n"
            "get_proposer_cls('mtp')\n"
            "print(sorted(m for m in sys.modules if m == 'mtpspec.engine' or m.startswith('mtpspec.engine.')))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=repo_env(), cwd=REPO,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]", p.stdout


class _FakeMTP(torch.nn.Module):
    def __init__(self, num_mtp_layers: int):
        super().__init__()
        self.num_mtp_layers = num_mtp_layers

    def compute_logits(self, hidden, spec_step_idx=0):
        return hidden


def test_registry_builds_the_mtp_proposer() -> None:
    assert get_proposer_cls("mtp") is MTPProposer and issubclass(MTPProposer, Proposer)
    with pytest.raises(ValueError, match="ngram.*mtp"):
        get_proposer_cls("ngram")
    spec = SpeculativeConfig(num_speculative_tokens=3, use_local_argmax_reduction=False)
    prop = build_proposer(spec, _FakeMTP(1), block_size=4, max_position=64)
    assert isinstance(prop, MTPProposer) and (prop.k, prop.block_size, prop.max_position) == (3, 4, 64)


@pytest.mark.parametrize("k,layers,first,steps", [
    (1, 1, (0,), ()),
    (3, 1, (0,), ((1, True), (2, True))),
    (2, 2, (0, 1), ((1, True),)),
    (5, 2, (0, 1), ((1, True), (2, True), (3, True), (4, True), (0, False), (1, False))),
    (3, 4, (0, 1, 2), ((1, True), (2, True), (0, False), (1, False), (2, False))),
])
def test_mtp_graph_units(k: int, layers: int, first: tuple, steps: tuple) -> None:
    """Every draft-model call kind of a pure-decode step (what the runner read from the proposer's
    private ``_used_layers`` / ``_top`` before)."""
    prop = MTPProposer(_FakeMTP(layers), k, False, 4, 64)
    units = prop.graph_units()
    assert isinstance(units, GraphUnits)
    assert units.first_pass_layers == first and units.step_units == steps
    h = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    assert units.draft_fn(h, 0).tolist() == [1, 0]


class _HookRecorder(MTPProposer):
    def __init__(self, *a):
        super().__init__(*a)
        self.events: List[tuple] = []

    def on_prefill_begin(self, attn_metadata):
        self.events.append(("prefill_begin", attn_metadata.num_seqs))

    def on_prefill_end(self, attn_metadata):
        self.events.append(("prefill_end", attn_metadata.num_seqs))

    def on_multi_step_decode_begin(self, num_seqs, num_steps):
        self.events.append(("decode_begin", num_seqs, num_steps))

    def on_multi_step_decode_end(self, num_seqs, num_steps):
        self.events.append(("decode_end", num_seqs, num_steps))


def test_graph_capture_calls_the_hooks_around_the_units(monkeypatch) -> None:
    """``GraphedForward.capture`` (``"cuda"`` mode, the capture itself stubbed so it runs on the
    CPU): per padded size, verify, then the first-pass units between the prefill hooks, then the
    step units between the multi-step decode hooks."""
    from mtpspec.engine.forward import GraphedForward

    k = 3
    prop = _HookRecorder(_FakeMTP(2), k, False, 4, 64)
    fwd = GraphedForward(None, None, k, 2, 4, 8, torch.float32, torch.device("cpu"), "cuda", 64)

    def fake_capture_one(self, fn, meta):
        prop.events.append(("capture", meta.num_seqs, meta.max_query_len))
        return None, ()

    monkeypatch.setattr(GraphedForward, "_capture_one", fake_capture_one)
    fwd.capture(prop)
    assert fwd.capture_failed is None
    units = prop.graph_units()
    for bp in (2, 1):
        assert ("verify", bp, k) in fwd.graphs
        assert all(key in fwd.graphs for key in fwd.first_pass_keys(bp, k, units))
        assert ("firsttop", bp, units.first_pass_layers[0], k) in fwd.graphs  # the first draft inside the graph
        assert all(("step", bp, i, wt) in fwd.graphs for i, wt in units.step_units)
    per_size = lambda bp: ([("capture", bp, k + 1), ("prefill_begin", bp)]  # noqa: E731
                           + [("capture", bp, k + 1)] * len(units.first_pass_layers)
                           + [("prefill_end", bp), ("decode_begin", bp, k - 1)]
                           + [("capture", bp, 1)] * len(units.step_units) + [("decode_end", bp, k - 1)])
    assert prop.events == per_size(2) + per_size(1)


def test_first_top_without_its_graph_runs_eagerly() -> None:
    """A graphed forward whose ``firsttop`` unit was not captured (no ``draft_fn`` at capture) runs
    the first pass, the row pick and the draft eagerly on the real layout (it used to look up the
    uncaptured ``first`` unit); the same outputs as the eager forward."""
    from mtpspec.engine.forward import GraphedForward
    from mtpspec.spec_decode.draft_forward import EagerDraftForward

    class Toy(torch.nn.Module):
        def forward(self, ids, pos, hidden, spec_step_idx=0):
            return hidden * 2 + ids[:, None].float() + pos[:, None].float()

    fwd = GraphedForward(None, Toy(), 1, 2, 4, 3, torch.float32, torch.device("cpu"), "cuda", 64)
    fwd.active, fwd.num_seqs, fwd.step_k = 2, 2, 1
    ids, pos = torch.tensor([3, 4, 5, 6]), torch.tensor([7, 8, 9, 10])
    hidden, rows = torch.randn(4, 3), torch.tensor([1, 2])
    top = lambda h, i: h.argmax(-1)  # noqa: E731
    got = fwd.mtp_first_top(ids, pos, hidden, None, 0, rows, top)
    want = EagerDraftForward(Toy()).mtp_first_top(ids, pos, hidden, None, 0, rows, top)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

"""`mtpspec tp-demo`'s guards (found by a new-user pass: ``-tp 64`` on a 2-core, 23 GiB machine
spawned 64 CPU ranks of ~450 MB, the out-of-memory killer fired, and the run ended in the
launcher's traceback ``RuntimeError: launch: rank 39 died with exit code -9 ...``)."""

from __future__ import annotations

import argparse

import pytest

from mtpspec.distributed.launcher import RemoteTraceback
from mtpspec.entrypoints import tp_demo


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    tp_demo.add_parser(p.add_subparsers(dest="command"))
    return p.parse_args(["tp-demo", "--num-seqs", "4", "--vocab-size", "1000", *argv])


@pytest.fixture
def two_cpus(monkeypatch):
    """Two CPUs, CPU ranks, and a launch that records its calls (raising what ``launch_error`` holds)."""
    calls, box = [], {"error": None}

    def fake_launch(fn, world_size, *args, **kw):
        calls.append(world_size)
        if box["error"] is not None:
            raise box["error"]
        rows = {name: {} for name in ("draft ids: compute_logits + argmax", "draft ids: get_top_tokens")}
        return [(rows, True, True)] * world_size
    monkeypatch.setattr(tp_demo, "cpu_count", lambda: 2)
    monkeypatch.setattr(tp_demo, "launch", fake_launch)
    monkeypatch.setattr("mtpspec.distributed.parallel_state.default_backend", lambda world_size: "gloo")
    return calls, box


def test_more_cpu_ranks_than_cpus_is_refused_unless_oversubscribed(two_cpus, capsys) -> None:
    calls, _ = two_cpus
    assert tp_demo.run(_args("-tp", "64")) == 2
    err = capsys.readouterr().err
    assert err == ("error: --tensor-parallel-size 64 would start 64 CPU ranks (processes of about 0.5 GB each) on 2 "
                   "CPUs; use at most 2, or pass --oversubscribe\n"), err
    assert calls == []  # nothing spawned
    assert tp_demo.run(_args("-tp", "2")) == 0 and calls == [2]
    assert tp_demo.run(_args("-tp", "3", "--oversubscribe")) == 0 and calls == [2, 3]


def test_a_rank_that_dies_is_one_error_line(two_cpus, capsys) -> None:
    calls, box = two_cpus
    box["error"] = RuntimeError("launch: rank 1 died with exit code -9 without reporting a result")
    assert tp_demo.run(_args("-tp", "2")) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: launch: rank 1 died with exit code -9 without reporting a result (SIGKILL: ")
    assert "out-of-memory killer" in err and err.count("\n") == 1 and "Traceback" not in err, err
    # a rank's allocation that fails (sizes too large for memory): one line too
    exc = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 30720000000 bytes. Error code 12 (Cannot allocate memory)")
    exc.__cause__ = RemoteTraceback("--- traceback of rank 0 ---")
    box["error"] = exc
    assert tp_demo.run(_args("-tp", "2")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: a rank ran out of memory ([enforce fail") and err.count("\n") == 1, err
    assert "lower --vocab-size, --hidden-size or --num-seqs" in err, err
    # a rank's own exception keeps its traceback (a bug to read, not a resource limit)
    exc = RuntimeError("boom")
    exc.__cause__ = RemoteTraceback("--- traceback of rank 0 ---")
    box["error"] = exc
    with pytest.raises(RuntimeError, match="boom"):
        tp_demo.run(_args("-tp", "2"))


def test_cpu_count_is_the_affinity_mask() -> None:
    import os
    n = tp_demo.cpu_count()
    assert 1 <= n <= (os.cpu_count() or n)
    if hasattr(os, "sched_getaffinity"):  # the CPUs this process may run on, not the machine's
        assert n == len(os.sched_getaffinity(0))

"""Tensor parallelism (gloo, 2 CPU ranks): lossless speculative decoding, identical collective
sequences on every rank, and the ``torchrun`` path (every process a rank, rank 0 broadcasting).

References are single-process (tp 1) plain greedy runs of the same checkpoint.
"""

from __future__ import annotations

import json
import signal
from typing import Any, List

import pytest
import torch.distributed as dist

from test_engine_fixtures import OracleDrafts, make_model, mixed_prompts, repo_env, token_prompts

from mtpspec import LLM, SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LLM_KW = dict(max_model_len=64, block_size=4, num_kv_blocks=96, max_num_seqs=4, seed=0)

_LOG: List[tuple] = []
_ORIG: dict = {}
_OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
        "reduce_scatter", "all_to_all_single")


def install_recorder(runner: Any) -> bool:
    """Runs on each rank: wrap torch.distributed's collectives to log (op, shape, dtype)."""
    for name in _OPS:
        if name in _ORIG or not hasattr(dist, name):
            continue
        orig = getattr(dist, name)
        _ORIG[name] = orig

        def wrapped(*args, _name=name, _orig=orig, **kwargs):
            t = args[0] if args else None
            if isinstance(t, list):
                t = t[0]
            _LOG.append((_name, tuple(t.shape) if hasattr(t, "shape") else None, str(getattr(t, "dtype", ""))))
            return _orig(*args, **kwargs)

        setattr(dist, name, wrapped)
    return True


_STEPS: List[tuple] = []


def install_step_recorder(runner: Any) -> bool:
    """Runs on each rank: remember every step's tokens and drafts as this rank computed them."""
    inner = runner.execute_model

    def wrapped(step):
        out = inner(step)
        _STEPS.append((out.new_token_ids, out.draft_token_ids))
        return out

    runner.execute_model = wrapped
    return True


def fetch_steps(runner: Any) -> List[tuple]:
    return list(_STEPS)


def fetch_log(runner: Any) -> List[tuple]:
    out = list(_LOG)
    _LOG.clear()
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_tp"))
    _, cfg = make_model(path, seed=11, tokenizer=False)
    prompts = mixed_prompts(6, cfg.vocab_size, seed=4)
    with LLM(path, **LLM_KW) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(token_prompts(prompts), SP, use_tqdm=False)]
        long = llm.generate(token_prompts(prompts), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                            use_tqdm=False)
    oracle = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, long)}
    return path, cfg, prompts, ref, oracle


def test_tp2_spec_lossless_and_same_collectives_on_every_rank(setup) -> None:
    path, cfg, prompts, ref, oracle = setup
    with LLM(path, tensor_parallel_size=2, speculative_config={"num_speculative_tokens": 3,
                                                               "use_local_argmax_reduction": True},
             fuse_allreduce_rmsnorm=True, **LLM_KW) as llm:
        llm.llm_engine.draft_hook = OracleDrafts(oracle, cfg.vocab_size, corrupt=0.35)
        assert llm.collective_rpc(install_recorder) == [True, True]
        assert llm.collective_rpc(install_step_recorder) == [True, True]
        outs = llm.generate(token_prompts(prompts), SP, use_tqdm=False)
        logs = llm.collective_rpc(fetch_log)
        metrics = llm.get_metrics()
        # seeded sampling: every rank must draw the same tokens (counter-based draws, same logits)
        llm.llm_engine.draft_hook = None
        sampled = llm.generate(token_prompts(prompts[:3]), [
            SamplingParams(temperature=1.0, top_p=0.95, seed=s, max_tokens=10, ignore_eos=True) for s in range(3)],
            use_tqdm=False)
        steps = llm.collective_rpc(fetch_steps)
    assert len(steps[0]) > 10 and steps[0] == steps[1]
    assert len({tuple(o.outputs[0].token_ids) for o in sampled}) == 3
    assert [o.outputs[0].token_ids for o in outs] == ref
    hist = metrics["accepted_length_histogram"]
    assert sum(1 for h in hist if h) >= 3, hist  # sequences accepted different counts
    assert len(logs) == 2 and len(logs[0]) > 100
    assert logs[0] == logs[1]
    ops = {op for op, _, _ in logs[0]}
    assert {"all_reduce", "all_gather"} <= ops
    # local argmax: the draft steps gather [T, 2] float64 pairs, never [T, vocab] logits
    assert any(shape is not None and shape[-1:] == (2,) and dt == "torch.float64" for _, shape, dt in logs[0])
    assert metrics["comm_bytes_per_step"]["all_reduce"] > 0


@pytest.mark.parametrize("k,local_argmax,fused,seq_parallel,graph_mode",
                         [(1, False, False, True, "off"), (5, False, True, False, "static")])
def test_tp2_spec_lossless_variants(setup, k: int, local_argmax: bool, fused: bool, seq_parallel: bool,
                                    graph_mode: str) -> None:
    """``graph_mode="static"``: the CUDA-graph code path (padded static buffers) without capture."""
    path, cfg, prompts, ref, oracle = setup
    with LLM(path, tensor_parallel_size=2, speculative_config={"num_speculative_tokens": k,
                                                               "use_local_argmax_reduction": local_argmax},
             fuse_allreduce_rmsnorm=fused, sequence_parallel=seq_parallel, graph_mode=graph_mode, **LLM_KW) as llm:
        llm.llm_engine.draft_hook = OracleDrafts(oracle, cfg.vocab_size, corrupt=0.3)
        outs = llm.generate(token_prompts(prompts), SP, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert llm.get_metrics()["num_accepted_tokens"] > 0


def test_tp2_chunked_prefill_lossless_and_same_collectives(setup) -> None:
    """Chunked prefill at tp 2 (3-token chunks, some steps with no sampled row at all): the same
    tokens and drafts on both ranks, the same collective sequence, the tp-1 greedy tokens."""
    path, cfg, prompts, ref, oracle = setup
    with LLM(path, tensor_parallel_size=2, speculative_config={"num_speculative_tokens": 3,
                                                               "use_local_argmax_reduction": True},
             long_prefill_token_threshold=3, enable_prefix_caching=False, **LLM_KW) as llm:
        # (no prefix caching: the repeated prompt below must be prefilled chunk by chunk again)
        llm.llm_engine.draft_hook = OracleDrafts(oracle, cfg.vocab_size, corrupt=0.3)
        assert llm.collective_rpc(install_recorder) == [True, True]
        assert llm.collective_rpc(install_step_recorder) == [True, True]
        outs = llm.generate(token_prompts(prompts), SP, use_tqdm=False)
        alone = llm.generate(token_prompts(prompts[1:2]), SP, use_tqdm=False)  # 20 tokens: 6 steps, no sampled row
        logs = llm.collective_rpc(fetch_log)
        steps = llm.collective_rpc(fetch_steps)
    assert [o.outputs[0].token_ids for o in outs] == ref and alone[0].outputs[0].token_ids == ref[1]
    assert len(prompts[1]) == 20 and steps[0] == steps[1]
    assert sum(new == [[]] for new, _ in steps[0]) >= 6  # steps holding one partial chunk and nothing else
    assert logs[0] == logs[1] and len(logs[0]) > 100


def _torchrun_rank(path: str, prompts, oracle, vocab: int):
    llm = LLM(path, tensor_parallel_size=2, speculative_config={"num_speculative_tokens": 3}, **LLM_KW)
    llm.llm_engine.draft_hook = OracleDrafts(oracle, vocab, corrupt=0.3)
    outs = llm.generate(token_prompts(prompts), SP, use_tqdm=False)
    again = llm.generate(token_prompts(prompts[:2]), SP, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].token_ids for o in again]


def test_under_torchrun_style_launch(setup) -> None:
    """Every process builds the LLM (WORLD_SIZE/RANK set, group initialised, as under torchrun)."""
    from mtpspec.distributed import launch
    path, cfg, prompts, ref, oracle = setup
    results = launch(_torchrun_rank, 2, path, prompts, oracle, cfg.vocab_size, timeout_s=240)
    for outs, again in results:
        assert outs == ref and again == ref[:2]


def test_llm_under_real_torchrun(tmp_path) -> None:
    """`torchrun --nproc-per-node 2 script.py`: every rank builds LLM(tp=2) and gets the outputs of a
    single-process run (fp32, greedy, k = 3, the bundled demo model)."""
    import subprocess
    import sys
    import textwrap

    from mtpspec import LLM, SamplingParams, demo_model_path
    from mtpspec.distributed.launcher import find_free_port

    prompts = ["Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:",
               "Question: A box holds 12 eggs. How many eggs are in 5 boxes?\nAnswer:"]
    spec = {"method": "mtp", "num_speculative_tokens": 3, "use_local_argmax_reduction": True}
    params = SamplingParams(temperature=0.0, max_tokens=24)
    llm = LLM(demo_model_path(), dtype="float32", device="cpu", speculative_config=spec, max_num_seqs=4)
    try:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    script = tmp_path / "tr_llm.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, torch
        torch.set_num_threads(1)
        from mtpspec import LLM, SamplingParams, demo_model_path
        llm = LLM(demo_model_path(), tensor_parallel_size=2, dtype="float32", device="cpu",
                  speculative_config={spec!r}, max_num_seqs=4)
        outs = llm.generate({prompts!r}, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
        with open(os.path.join({str(tmp_path)!r}, "rank" + os.environ["RANK"] + ".json"), "w") as f:
            json.dump([o.outputs[0].token_ids for o in outs], f)
        llm.shutdown()
    """))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(find_free_port()), str(script)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):  # one file per rank: torchrun interleaves the ranks' stdout
        with open(tmp_path / f"rank{rank}.json") as f:
            assert json.load(f) == ref, f"rank {rank}"


@pytest.mark.parametrize("tp", [1, 2])
def test_ctrl_c_in_generate_aborts_its_requests_and_the_llm_stays_usable(setup, tp) -> None:
    """Ctrl-C reaches the whole process group. A new-user pass at tp 2: the ranks died of it and the
    caller got ``WorkerError: the executor was shut down`` instead of ``KeyboardInterrupt`` (tp 1
    was fine). Now the ranks ignore SIGINT and the driver, interrupted while it waits for a step,
    reads and drops that step's replies before the next message: ``KeyboardInterrupt`` comes out of
    ``generate``, its requests are aborted, and the next ``generate`` gives the plain greedy tokens."""
    import os
    import signal

    path, cfg, prompts, ref, _ = setup
    with LLM(path, tensor_parallel_size=tp, speculative_config={"num_speculative_tokens": 3}, **LLM_KW) as llm:
        ex = llm.llm_engine.executor
        if tp > 1:
            for p in ex.procs:  # the signal a terminal's Ctrl-C sends every process of the group
                os.kill(p.pid, signal.SIGINT)
        calls = {"n": 0}
        orig = ex.execute_async

        def interrupted(step):  # the driver is interrupted inside its 5th step (after the ranks got it)
            calls["n"] += 1
            if calls["n"] == 5:
                if tp > 1:
                    real_recv = ex._recv

                    def recv_once(rank, timeout_s):
                        ex._recv = real_recv
                        raise KeyboardInterrupt
                    ex._recv = recv_once
                    return orig(step)
                raise KeyboardInterrupt
            return orig(step)
        ex.execute_async = interrupted
        with pytest.raises(KeyboardInterrupt):
            llm.generate(token_prompts(prompts), SP, use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
        if tp > 1:
            assert all(p.is_alive() for p in ex.procs) and ex._owed == [0, 1]
        outs = llm.generate(token_prompts(prompts), SP, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        if tp > 1:
            # a real SIGINT just after a reply's bytes are read: held off until the reply is struck off
            # the owed list (else the next message would wait for a reply already consumed)
            ex.execute_async, ex.step_timeout_s = orig, 20.0
            conn, real = ex.conns[1], ex.conns[1].recv
            state = {"n": 0}

            def recv_then_sigint():
                out = real()
                state["n"] += 1
                if state["n"] == 4:
                    os.kill(os.getpid(), signal.SIGINT)
                return out
            conn.recv = recv_then_sigint
            with pytest.raises(KeyboardInterrupt):
                llm.generate(token_prompts(prompts), SP, use_tqdm=False)
            conn.recv = real
            assert ex._owed == []  # rank 1's reply was read and struck off before the interrupt
            outs = llm.generate(token_prompts(prompts), SP, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_ctrl_c_while_llm_starts_stops_the_ranks(setup, monkeypatch) -> None:
    """The ranks ignore SIGINT, so an interrupt while ``LLM(...)`` is still starting (here: the
    adaptive step-cost timing, a minute or more on a CPU) must stop them itself, not leave them
    running with their memory until the half-built LLM is collected."""
    from mtpspec.engine.executor import MultiprocExecutor
    path, _, _, _, _ = setup
    seen = []

    def interrupted(self, fn, *args):
        seen.append(self)
        raise KeyboardInterrupt
    monkeypatch.setattr(MultiprocExecutor, "collective_rpc", interrupted)
    with pytest.raises(KeyboardInterrupt):
        LLM(path, tensor_parallel_size=2, speculative_config={"num_speculative_tokens": 3, "adaptive": True}, **LLM_KW)
    assert len(seen) == 1 and seen[0]._closed and not any(p.is_alive() for p in seen[0].procs)


def kill_rank_0(runner: Any) -> bool:
    """Runs on each rank: rank 0 dies of SIGKILL (as from the out-of-memory killer)."""
    import os
    import signal
    if dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def test_a_killed_rank_is_named_once_with_its_signal(setup) -> None:
    """A rank killed by a signal (SIGKILL: the out-of-memory killer, ``kill -9``) wrote nothing, so the
    error said ``rank 0 died (exit code -9, SIGKILL); rank 0 exited (exit code -9) without a reply; its
    output above says why``: the same death twice, and output that is not there. Now one clause."""
    import os
    import signal

    from mtpspec.engine.executor import WorkerError
    path, _, prompts, _, _ = setup
    with LLM(path, tensor_parallel_size=2, speculative_config={"num_speculative_tokens": 2}, **LLM_KW) as llm:
        procs = llm.llm_engine.executor.procs
        with pytest.raises(WorkerError) as info:  # killed while it serves a message
            llm.collective_rpc(kill_rank_0)
        msg = str(info.value)
        assert msg == "rank 0 died (exit code -9, SIGKILL) without a reply", msg
        assert not any(p.is_alive() for p in procs)
    with LLM(path, tensor_parallel_size=2, **LLM_KW) as llm:  # killed while idle
        procs = llm.llm_engine.executor.procs
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(timeout=10)
        with pytest.raises(WorkerError) as info:
            llm.generate(token_prompts(prompts), SP, use_tqdm=False)
        msg = str(info.value)
        assert msg.startswith("rank 1 died (exit code -9, SIGKILL)") and msg.count("rank 1 ") == 1, msg
        assert "output above" not in msg, msg


def test_a_dead_rank_s_own_report_is_raised_as_is_whatever_its_wording() -> None:
    """A step's error that is the one dead rank's own report is raised as is; another rank's error is
    prefixed with the death. The report was told by its message starting with ``rank R `` (R the dead
    rank), so rewording a message would have named the same death twice; now its ``rank`` tells."""
    from mtpspec.engine.executor import MultiprocExecutor, WorkerError

    class Conn:
        def send(self, msg):
            pass

        def close(self):
            pass

    class Proc:
        def __init__(self, exitcode):
            self.exitcode = exitcode

        def is_alive(self):
            return self.exitcode is None

        def join(self, timeout=None):
            pass

        def terminate(self):
            self.exitcode = -15
        kill = terminate

    def failing(err):  # rank 1 was SIGKILLed; the step's first reply raises err
        ex = MultiprocExecutor.__new__(MultiprocExecutor)
        ex.conns, ex.procs, ex._closed, ex._owed = [Conn(), Conn()], [Proc(None), Proc(-9)], False, []
        ex.step_timeout_s = 1.0

        def recv(rank, timeout_s):
            raise err
        ex._recv = recv
        with pytest.raises(WorkerError) as info:
            ex.collective_rpc(len)
        return info.value

    own = WorkerError("the process of rank 1 is gone (exit code -9, SIGKILL)")
    own.rank = 1
    assert failing(own) is own
    other = WorkerError("rank 0 failed:\nRuntimeError: Connection reset by peer")
    other.rank = 0
    err = failing(other)
    assert str(err).startswith("rank 1 died (exit code -9, SIGKILL); rank 0 failed") and err.__cause__ is other, err


def test_ranks_start_again_on_another_port_when_theirs_was_taken(setup, busy_port) -> None:
    """The rendezvous port is picked free, then bound by rank 0's store a few seconds later; a process
    that took it meanwhile made the launch fail (``DistNetworkError ... EADDRINUSE``, a traceback) with
    nothing wrong in the command. The ranks now start again on a newly picked port."""
    path, _, prompts, ref, _ = setup
    busy_port.first()
    with LLM(path, tensor_parallel_size=2, **LLM_KW) as llm:
        outs = llm.generate(token_prompts(prompts), SP, use_tqdm=False)
    assert len(busy_port.picks) == 2 and [o.outputs[0].token_ids for o in outs] == ref


def test_shutdown_ends_a_frozen_rank(setup, monkeypatch) -> None:
    """A rank stopped by SIGSTOP (frozen): the other rank's collective timed out and the command printed
    its error, but shutdown's SIGTERM does not end a stopped process, and at exit multiprocessing joined
    the daemonic rank without a timeout: `mtpspec generate -tp 2` never exited. Shutdown now ends it
    with SIGKILL after SIGTERM."""
    import os
    import signal
    import time

    from mtpspec.engine import executor
    path, _, _, _, _ = setup
    monkeypatch.setattr(executor, "SHUTDOWN_JOIN_S", 1.0)
    llm = LLM(path, tensor_parallel_size=2, **LLM_KW)
    procs = llm.llm_engine.executor.procs
    os.kill(procs[1].pid, signal.SIGSTOP)
    t0 = time.monotonic()
    llm.shutdown()
    assert not any(p.is_alive() for p in procs) and time.monotonic() - t0 < 15


_SPAWN_MASK_SCRIPT = '''
import multiprocessing as mp
import signal
import sys

from mtpspec.engine import executor


def report(conn):
    conn.send(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))


if __name__ == "__main__":
    held = getattr(executor, sys.argv[1])
    ctx = mp.get_context("spawn")
    seen = []
    for _ in range(2):  # the first start also starts the resource tracker
        parent, child = ctx.Pipe()
        p = ctx.Process(target=report, args=(child,))
        with held():
            p.start()
        seen.append(parent.recv())
        p.join()
    print(seen)
'''


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="needs pthread_sigmask")
def test_a_process_spawned_while_sigint_is_held_starts_with_it_blocked(tmp_path) -> None:
    """CI saw a rank print a ``KeyboardInterrupt`` traceback from its ``site`` import after Ctrl-C, although
    ranks start with SIGINT blocked: the first spawn starts ``multiprocessing``'s resource tracker, whose
    start *unblocks* SIGINT in the parent, so the rank spawned right after started with it deliverable.
    ``sigint_held_for_spawn`` starts the tracker first. A fresh process (no tracker yet): with plain
    ``sigint_held`` the first child read ``False`` (CPython 3.11)."""
    import subprocess
    import sys
    script = tmp_path / "spawn_mask.py"
    script.write_text(_SPAWN_MASK_SCRIPT)
    out = subprocess.run([sys.executable, str(script), "sigint_held_for_spawn"], capture_output=True, text=True,
                         env=repo_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[True, True]", (out.stdout, out.stderr)

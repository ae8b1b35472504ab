"""A script that spawns ranks (tensor_parallel_size > 1, ``launch``) without the
``if __name__ == "__main__":`` guard gets one clear RuntimeError, at once, instead of a bare
EOFError after its ranks died; with the guard the same script runs (tp 2 on gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from test_engine_fixtures import make_model, repo_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUARD = 'if __name__ == "__main__":'


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("tiny_guard"))
    make_model(p, seed=21)
    return p


def _run_script(folder, name: str, body: str, timeout_s: float = 240.0):
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write(textwrap.dedent(body))
    env = repo_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, path], cwd=folder, env=env, capture_output=True, text=True,
                         timeout=timeout_s)  # a hang fails the test (TimeoutExpired)
    return res, time.monotonic() - t0


LLM_LINE = ("llm = LLM({model!r}, tensor_parallel_size=2, device='cpu', max_model_len=32, block_size=4, "
            "num_kv_blocks=64, speculative_config={{'num_speculative_tokens': 1}})")


@pytest.mark.parametrize("name,body,line", [
    ("noguard.py", """\
        from mtpspec import LLM, SamplingParams
        {llm}
        out = llm.generate([{{"prompt_token_ids": [5, 6, 7]}}], SamplingParams(temperature=0.0, max_tokens=4))
        print("TOKENS", out[0].outputs[0].token_ids)
        """, 2),
    ("main_unguarded.py", """\
        from mtpspec import LLM, SamplingParams


        def main():
            {llm}
            print("TOKENS", llm.generate([{{"prompt_token_ids": [5, 6]}}], SamplingParams(max_tokens=2)))


        main()
        """, 9),
    ("launch_unguarded.py", """\
        import os
        from mtpspec.distributed.launcher import launch
        print(launch(os.getpid, 2))
        """, 3),
])
def test_missing_main_guard_is_one_clear_error(model, tmp_path, name, body, line) -> None:
    res, elapsed = _run_script(str(tmp_path), name, body.format(llm=LLM_LINE.format(model=model)))
    err = res.stderr
    assert res.returncode == 1 and "TOKENS" not in res.stdout, (res.stdout, err)
    last = err.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: ") and GUARD in last and f"{name} line {line} runs at import time" in last, err
    assert "EOFError" not in err and "bootstrapping" not in err  # no rank was started
    assert elapsed < 120


def test_guarded_script_runs_with_tp2(model, tmp_path) -> None:
    body = f"""\
        from mtpspec import LLM, SamplingParams

        if __name__ == "__main__":
            {LLM_LINE.format(model=model)}
            out = llm.generate([{{"prompt_token_ids": [5, 6, 7]}}], SamplingParams(temperature=0.0, max_tokens=4))
            print("TOKENS", len(out[0].outputs[0].token_ids))
            llm.shutdown()
        """
    res, _ = _run_script(str(tmp_path), "guarded.py", body)
    assert res.returncode == 0 and "TOKENS 4" in res.stdout, res.stderr[-3000:]


@pytest.mark.parametrize("guarded", [False, True])
def test_rank_that_exits_without_reply_is_a_worker_error(tmp_path, monkeypatch, guarded) -> None:
    """The fall-back when a rank dies before replying: WorkerError with its exit code, not EOFError,
    and a hint about the guard when the main script has none."""
    import multiprocessing as mp
    import types

    from mtpspec.engine.executor import MultiprocExecutor, WorkerError

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=os._exit, args=(3,), daemon=True)
    proc.start()
    child.close()  # as MultiprocExecutor does: the only write end left was the rank's
    script = tmp_path / "user_script.py"
    script.write_text("x = 1\n" + (GUARD + "\n    print(x)\n" if guarded else "print(x)\n"))
    fake_main = types.ModuleType("__main__")
    fake_main.__file__, fake_main.__spec__ = str(script), None
    ex = object.__new__(MultiprocExecutor)
    ex.conns, ex.procs, ex._closed = [parent], [proc], False
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "__main__", fake_main)
        with pytest.raises(WorkerError, match="rank 0 .*exit code 3") as info:
            ex._recv(0, 30)
    assert (GUARD in str(info.value)) == (not guarded) and ("user_script.py" in str(info.value)) == (not guarded)
    proc.join()
    parent.close()


def test_start_up_reads_the_ranks_as_they_reply_and_the_first_failure_wins() -> None:
    """A rank that fails while starting (e.g. its KV cache does not fit in memory) ends the start-up
    at once, though a rank before it has not replied: that rank may wait in a collective (the
    minimum of the block counts) for the failed one, under NCCL until its timeout, and the start-up
    read the ranks in rank order, so it waited for it (10 minutes by default)."""
    import multiprocessing as mp

    from mtpspec.engine.executor import MultiprocExecutor, WorkerInputError

    class _Silent:  # a live rank that never replies
        exitcode = None

        def __init__(self):
            self.sentinel, self._w = os.pipe()

        def is_alive(self):
            return True

    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [_Silent(), _Silent()]
    ex = object.__new__(MultiprocExecutor)
    ex.conns, ex.procs, ex._closed, ex._owed = [p for p, _ in pipes], procs, False, []
    try:
        pipes[1][1].send(("err", {"traceback": "Traceback ...\nKVCacheMemoryError: too big",
                                  "message": "the KV cache does not fit in memory", "input_error": True}))
        t0 = time.monotonic()
        with pytest.raises(WorkerInputError, match="rank 1: the KV cache does not fit in memory"):
            ex._recv_all(20)
        assert time.monotonic() - t0 < 5
        for r in (1, 0):  # replies in any order come back in rank order
            pipes[r][1].send(("ready", 10 + r))
        assert ex._recv_all(20) == [10, 11]
        # ranks failing alike within the grace period: the lowest rank's error is the one reported
        import threading

        def err(r):
            return ("err", {"traceback": "...", "message": f"bad checkpoint ({r})", "input_error": True})
        pipes[1][1].send(err(1))
        later = threading.Timer(0.3, lambda: pipes[0][1].send(err(0)))
        later.start()
        with pytest.raises(WorkerInputError, match=r"rank 0: bad checkpoint \(0\)"):
            ex._recv_all(20)
        later.join()
    finally:
        for parent, child in pipes:
            parent.close()
            child.close()
        for p in procs:
            os.close(p.sentinel)
            os.close(p._w)


def test_a_rank_s_input_error_is_not_hidden_by_a_lower_rank_s_broken_collective() -> None:
    """Review: a rank that fails alone (its KV cache does not fit) closes the process group, and
    rank 0, waiting in the block-count all-reduce with it, fails a moment later with a connection
    error; the start-up must report the cause (rank 1's input error, an ``error: ...`` line), not
    rank 0's. A lower rank's input error still wins over a higher rank's (ranks that fail alike
    report as rank 0)."""
    from mtpspec.engine.executor import MultiprocExecutor, WorkerError, WorkerInputError

    class Conn:
        def poll(self, timeout=None):
            return True

    class Proc:
        def is_alive(self):
            return True

    ex = object.__new__(MultiprocExecutor)
    ex.conns, ex.procs = [Conn(), Conn()], [Proc(), Proc()]
    cause = WorkerInputError("rank 1: the KV cache does not fit in memory: ...")
    for lower, want in ((WorkerError("rank 0 failed: RuntimeError: Connection closed by peer"), cause),
                        (WorkerInputError("rank 0: the KV cache does not fit in memory: ..."), None)):
        def recv(rank, timeout_s, lower=lower):
            raise lower
        ex._recv = recv
        got = ex._lowest_failure(1, cause, {}, 0.1)
        assert got is (want if want is not None else lower), (lower, got)
    # a lower rank's failure beats a higher rank's when neither is an input error
    other = WorkerError("rank 1 died")
    lower = WorkerError("rank 0 failed: RuntimeError: boom")
    ex._recv = lambda rank, timeout_s: (_ for _ in ()).throw(lower)
    assert ex._lowest_failure(1, other, {}, 0.1) is lower

"""Selecting the fused all-reduce + RMSNorm backend from the engine (``allreduce_backend``).

The p2p backend on CPU runs in Triton's interpreter over /dev/shm, so the end-to-end check
(an ``LLM`` at tp 2 with ``allreduce_backend="p2p"`` against ``"nccl"``) runs every op of the
spawned ranks interpreted: a tiny model, two prompts, a few tokens.
"""

from __future__ import annotations

from typing import Any, List

import pytest
import torch

from test_engine_fixtures import make_model, mixed_prompts, token_prompts

from mtpspec import LLM, SamplingParams
from mtpspec.config import ParallelConfig
from mtpspec.distributed.allreduce_rms_norm import (
    backend_usage, check_allreduce_backend_supported, close_allreduce_rms_norm_backend, fused_allreduce_rms_norm,
    get_allreduce_rms_norm_backend, init_allreduce_rms_norm_backend)
from mtpspec.distributed.p2p_allreduce_rms_norm import P2PAllReduceRMSNorm
from mtpspec.layers import RMSNorm

P2P = P2PAllReduceRMSNorm.name
SPEC = {"method": "mtp", "num_speculative_tokens": 2, "use_local_argmax_reduction": True}
KW = dict(max_model_len=48, block_size=4, num_kv_blocks=64, max_num_seqs=2, seed=0, device="cpu")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("tiny_backend"))
    make_model(p, seed=5, tokenizer=False)
    return p


# ------------------------------------------------------------------------ config-level checks
def test_bad_backend_name_lists_the_choices(path) -> None:
    with pytest.raises(ValueError, match=r"allreduce_backend must be one of \['nccl', 'p2p'\], got 'mpi'"):
        ParallelConfig(2, allreduce_backend="mpi")
    with pytest.raises(ValueError, match=r"\['nccl', 'p2p'\].*'custom'"):
        LLM(path, allreduce_backend="custom", **KW)
    with pytest.raises(ValueError, match=r"\['nccl', 'p2p'\]"):
        init_allreduce_rms_norm_backend("NCCL")
    assert ParallelConfig().allreduce_backend == "nccl" and ParallelConfig().fuse_allreduce_rmsnorm


def test_parallel_config_rejects_bad_values() -> None:
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            ParallelConfig(bad)
    with pytest.raises(ValueError, match="sequence_parallel"):
        ParallelConfig(2, sequence_parallel="yes")


def test_p2p_at_tp1_is_a_no_op(interp) -> None:
    """One process = tp 1: no collective, so 'p2p' installs nothing and the local path serves."""
    before = backend_usage().get("local", 0)
    assert init_allreduce_rms_norm_backend("p2p") is None
    assert get_allreduce_rms_norm_backend() == "p2p"
    h, r = torch.randn(3, 8), torch.randn(3, 8)
    norm = RMSNorm(8, eps=1e-6)
    fused_allreduce_rms_norm(h, r, norm)
    assert backend_usage()["local"] == before + 1
    close_allreduce_rms_norm_backend()
    assert get_allreduce_rms_norm_backend() == "nccl"


def test_p2p_on_cpu_without_interpreter_is_a_clear_error(no_interp) -> None:
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1.*allreduce_backend='nccl'"):
        check_allreduce_backend_supported("p2p", torch.device("cpu"))
    check_allreduce_backend_supported("nccl", torch.device("cpu"))  # always fine


def test_llm_tp2_p2p_on_cpu_without_interpreter_fails_before_any_rank_starts(path, no_interp, monkeypatch) -> None:
    import mtpspec.engine.executor as executor
    real = executor.MultiprocExecutor
    monkeypatch.setattr(executor, "MultiprocExecutor", lambda *a, **k: pytest.fail("ranks were started"))
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1.*allreduce_backend='nccl'"):
        LLM(path, tensor_parallel_size=2, allreduce_backend="p2p", speculative_config=SPEC, **KW)
    # the ranks check again at start (under torchrun, or when the driver's check is bypassed)
    from mtpspec.engine.executor import WorkerError
    from mtpspec.engine.arg_utils import EngineArgs
    monkeypatch.setattr(executor, "MultiprocExecutor", real)
    cfg = EngineArgs(model=path, tensor_parallel_size=2, speculative_config=SPEC, max_model_len=48, block_size=4,
                     num_kv_blocks=64, max_num_seqs=2, device="cpu").create_engine_config()
    cfg.parallel_config.allreduce_backend = "p2p"
    with pytest.raises(WorkerError, match="TRITON_INTERPRET=1"):
        executor.make_executor(cfg)


# ------------------------------------------------------------------------ the engine end to end
_STEPS: List[tuple] = []


def _record_steps(runner: Any) -> bool:
    inner = runner.execute_model

    def wrapped(step):
        out = inner(step)
        _STEPS.append((list(out.new_token_ids), list(out.draft_token_ids)))
        return out

    runner.execute_model = wrapped
    return True


def _steps(runner: Any) -> List[tuple]:
    return list(_STEPS)


def _usage(runner: Any) -> tuple:
    from mtpspec.distributed.allreduce_rms_norm import backend_usage, get_allreduce_rms_norm_backend, select_backend
    p2p_installed = select_backend(torch.zeros(1, runner.target.config.hidden_size)).name
    return get_allreduce_rms_norm_backend(), backend_usage(), p2p_installed


def _run(path: str, backend: str, prompts) -> tuple:
    with LLM(path, tensor_parallel_size=2, allreduce_backend=backend, speculative_config=SPEC, **KW) as llm:
        assert llm.parallel_config.allreduce_backend == backend
        llm.collective_rpc(_record_steps)
        outs = llm.generate(token_prompts(prompts), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.collective_rpc(_steps), llm.collective_rpc(_usage)


def test_llm_tp2_p2p_same_tokens_and_drafts_as_nccl(path, interp, monkeypatch) -> None:
    """Every step's accepted tokens and MTP drafts (which come out of the fused tail) agree, on
    both ranks; the p2p backend served the draft-step calls, NCCL the rest. The NCCL run uses the
    torch references (no interpreter: faster); the p2p run needs the interpreter in its ranks."""
    from mtpspec.config import ModelConfig
    vocab = ModelConfig.from_pretrained(path).vocab_size
    prompts = mixed_prompts(2, vocab, seed=3, max_len=6)
    toks_p, steps_p, usage_p = _run(path, "p2p", prompts)
    monkeypatch.delenv("TRITON_INTERPRET")
    toks_n, steps_n, usage_n = _run(path, "nccl", prompts)
    assert toks_p == toks_n and all(len(t) == 6 for t in toks_n)
    assert steps_p[0] == steps_n[0] and steps_p[1] == steps_p[0]  # rank 0 vs nccl; rank 1 vs rank 0
    assert any(d for _, d in steps_n[0])  # drafts were proposed
    for name, usage, installed in usage_n:
        assert name == "nccl" and P2P not in usage and installed != P2P
    for name, usage, installed in usage_p:
        assert name == "p2p" and installed == P2P and usage.get(P2P, 0) > 0


# ------------------------------------------------------------------------ tp-demo
def _tp_demo_args(backend: str):
    import argparse

    from mtpspec.entrypoints import tp_demo
    p = argparse.ArgumentParser()
    tp_demo.add_parser(p.add_subparsers(dest="command"))
    return tp_demo, p.parse_args(["tp-demo", "-tp", "2", "--oversubscribe", "--allreduce-backend", backend, "--num-seqs", "4",
                                  "--hidden-size", "64", "--vocab-size", "1000"])


def test_tp_demo_p2p_tail_equals_unfused(interp, capsys) -> None:
    tp_demo, args = _tp_demo_args("p2p")
    assert tp_demo.run(args) == 0
    out = capsys.readouterr().out
    assert "fused tail equals unfused: True" in out and "ran on the p2p backend" in out
    # the p2p tail issues no process-group collective at all
    assert [ln for ln in out.splitlines() if ln.startswith("tail: fused_allreduce_rms_norm")][0].split()[-2:] == ["none", "0"]


def test_tp_demo_p2p_without_interpreter_is_a_clear_error(no_interp, capsys) -> None:
    tp_demo, args = _tp_demo_args("p2p")
    assert tp_demo.run(args) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


def test_tp_demo_sizes_below_one_name_their_flag(capsys) -> None:
    tp_demo, args = _tp_demo_args("nccl")
    for attr, flag in (("tp", "--tensor-parallel-size"), ("num_seqs", "--num-seqs")):
        bad = type(args)(**{**vars(args), attr: 0})
        assert tp_demo.run(bad) == 2
        assert f"error: {flag} must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("dtype,size", [("bfloat16", 2), ("float32", 4)])
def test_tp_demo_counts_the_logits_bytes_of_its_dtype(capsys, dtype, size) -> None:
    """The README's figure (7,168 bytes a rank against 16,973,824 at tp 8, 64 sequences, vocab
    151,552) is bf16 logits: the full-logits all-gather sends (tp - 1) shards of num_seqs x
    vocab / tp values of the dtype's size; the local argmax 16-byte pairs whatever the dtype."""
    tp_demo, args = _tp_demo_args("nccl")
    args = type(args)(**{**vars(args), "dtype": dtype, "vocab_size": 1024})  # no vocab padding
    assert tp_demo.run(args) == 0
    out = capsys.readouterr().out
    sent = {ln.split(":")[1].strip().rsplit(None, 3)[0]: int(ln.split()[-1].replace(",", ""))
            for ln in out.splitlines() if ln.startswith("draft ids:")}
    assert sent == {"compute_logits + argmax": 4 * 512 * size, "get_top_tokens": 4 * 16}, out
    assert f"dtype={dtype}" in out and "local-argmax ids equal full argmax: True" in out

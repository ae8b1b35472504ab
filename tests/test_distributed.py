"""Collectives, byte counters, sp_shard/sp_all_gather and the launcher, on gloo ranks."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from mtpspec.distributed import (
    comm_stats, get_tensor_model_parallel_rank, get_tp_group, get_tensor_model_parallel_world_size, launch,
    reset_comm_stats, sp_all_gather, sp_shard, tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce, tensor_model_parallel_reduce_scatter)

TOKEN_COUNTS = [0, 1, 2, 3, 4, 5, 17, 2 * 4, 16 * 6]


def _data(seed, tp, shape, dtype=torch.float64):
    return torch.randn((tp,) + tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _collectives(tp, seed):
    rank = get_tensor_model_parallel_rank()
    assert get_tensor_model_parallel_world_size() == tp
    out = {}
    reset_comm_stats()
    x = _data(seed, tp, (5, 6))
    out["all_reduce"] = tensor_model_parallel_all_reduce(x[rank])
    out["all_reduce_bf16"] = tensor_model_parallel_all_reduce(x[rank].to(torch.bfloat16))
    out["all_reduce_untouched"] = x[rank]
    out["stats_ar"] = comm_stats()
    reset_comm_stats()
    for dim in (0, 1, -1):
        out[f"all_gather_{dim}"] = tensor_model_parallel_all_gather(x[rank], dim=dim)
    y = _data(seed + 1, tp, (3, 4 * tp, 2))
    out["all_gather_3d"] = tensor_model_parallel_all_gather(y[rank][:, :4], dim=1)
    out["stats_ag"] = comm_stats()
    # The NCCL branch (all_gather_into_tensor on dim 0, then a rank-major reshape) runs on gloo
    # too: check its layout here, since CI has no second GPU (known fault 8).
    g = get_tp_group()
    saved, g.backend = g.backend, "nccl"
    try:
        for dim in (0, 1, -1):
            out[f"all_gather_flat_{dim}"] = tensor_model_parallel_all_gather(x[rank], dim=dim)
        out["all_gather_flat_3d"] = tensor_model_parallel_all_gather(y[rank][:, :4], dim=1)
        _gather_into_out(out, "flat", x[rank], y[rank][:, :4], tp)  # the CUDA-graph verify logits' path
    finally:
        g.backend = saved
    _gather_into_out(out, "cat", x[rank], y[rank][:, :4], tp)
    reset_comm_stats()
    out["reduce_scatter_0"] = tensor_model_parallel_reduce_scatter(y[rank].transpose(0, 1).contiguous(), dim=0)
    out["reduce_scatter_1"] = tensor_model_parallel_reduce_scatter(y[rank], dim=1)
    out["stats_rs"] = comm_stats()
    for n in TOKEN_COUNTS:
        t = _data(seed + 2, 1, (n, 3))[0]
        shard = sp_shard(t)
        out[f"sp_{n}"] = (shard.clone(), sp_all_gather(shard)[:n])
    if tp > 1:
        with pytest.raises(ValueError, match="not divisible"):
            tensor_model_parallel_reduce_scatter(torch.zeros(tp + 1, 2), dim=0)
    return out


def _gather_into_out(out, tag, x, y, tp):
    """All-gathers written into a preallocated ``out`` (NaN-filled: a row left unwritten shows)."""
    for name, t, dim in (("0", x, 0), ("1", x, 1), ("-1", x, -1), ("3d", y, 1)):
        shape = list(t.shape)
        shape[dim] *= tp
        buf = torch.full(shape, float("nan"), dtype=t.dtype)
        res = tensor_model_parallel_all_gather(t, dim=dim, out=buf)
        assert tp == 1 or res is buf, "tp > 1 writes the result into out"
        out[f"all_gather_{tag}_out_{name}"] = res


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_collectives_match_single_process(tp):
    seed = int(torch.randint(0, 2**30, ()).item())
    results = launch(_collectives, tp, tp, seed)
    x = _data(seed, tp, (5, 6))
    y = _data(seed + 1, tp, (3, 4 * tp, 2))
    for rank, out in enumerate(results):
        torch.testing.assert_close(out["all_reduce"], x.sum(0))
        torch.testing.assert_close(out["all_reduce_bf16"].double(), x.to(torch.bfloat16).double().sum(0),
                                   rtol=2e-2, atol=2e-2)
        assert torch.equal(out["all_reduce_untouched"], x[rank]), "all-reduce must not modify its input"
        assert torch.equal(out["all_gather_0"], torch.cat(list(x), 0))
        assert torch.equal(out["all_gather_1"], torch.cat(list(x), 1))
        assert torch.equal(out["all_gather_-1"], torch.cat(list(x), 1))
        assert torch.equal(out["all_gather_3d"], torch.cat([y[r][:, :4] for r in range(tp)], 1))
        for dim, cat_dim in ((0, 0), (1, 1), (-1, 1)):
            assert torch.equal(out[f"all_gather_flat_{dim}"], torch.cat(list(x), cat_dim))
            for tag in ("flat", "cat"):
                assert torch.equal(out[f"all_gather_{tag}_out_{dim}"], torch.cat(list(x), cat_dim)), (tag, dim)
        for tag in ("flat", "cat"):
            assert torch.equal(out[f"all_gather_{tag}_out_3d"], torch.cat([y[r][:, :4] for r in range(tp)], 1))
        assert torch.equal(out["all_gather_flat_3d"], torch.cat([y[r][:, :4] for r in range(tp)], 1))
        full = y.sum(0)
        torch.testing.assert_close(out["reduce_scatter_1"], full[:, 4 * rank:4 * rank + 4])
        torch.testing.assert_close(out["reduce_scatter_0"], full.transpose(0, 1)[4 * rank:4 * rank + 4])
        nb = 5 * 6 * 8
        if tp == 1:
            assert out["stats_ar"] == {} and out["stats_ag"] == {} and out["stats_rs"] == {}
        else:
            ar = 2 * (tp - 1) * nb // tp + 2 * (tp - 1) * (nb // 4) // tp
            assert out["stats_ar"] == {"all_reduce": {"calls": 2, "bytes_sent": ar, "bytes_received": ar}}
            ag = 3 * (tp - 1) * nb + (tp - 1) * 3 * 4 * 2 * 8
            assert out["stats_ag"] == {"all_gather": {"calls": 4, "bytes_sent": ag, "bytes_received": ag}}
            rs = 2 * ((tp - 1) * (3 * 4 * tp * 2 * 8) // tp)
            assert out["stats_rs"] == {"reduce_scatter": {"calls": 2, "bytes_sent": rs, "bytes_received": rs}}
        for n in TOKEN_COUNTS:
            t = _data(seed + 2, 1, (n, 3))[0]
            shard, gathered = out[f"sp_{n}"]
            m = -(-n // tp)
            assert shard.shape == (m, 3), "each rank holds ceil(n / tp) rows"
            padded = torch.cat([t, torch.zeros((-n) % tp, 3, dtype=t.dtype)])
            assert torch.equal(shard, padded[rank * m:(rank + 1) * m])
            assert torch.equal(gathered, t), "gather + trim must give back exactly the n rows"


def _raise_on_rank(bad_rank):
    if get_tensor_model_parallel_rank() == bad_rank:
        raise KeyError(f"planted failure on rank {bad_rank}")
    tensor_model_parallel_all_reduce(torch.ones(2))
    return "ok"


def _die_on_rank(bad_rank):
    if get_tensor_model_parallel_rank() == bad_rank:
        os._exit(3)
    tensor_model_parallel_all_reduce(torch.ones(2))


def _hang_on_rank(bad_rank):
    if get_tensor_model_parallel_rank() == bad_rank:
        time.sleep(60)
    tensor_model_parallel_all_reduce(torch.ones(2))


def _rank_id():
    return get_tensor_model_parallel_rank() * 10


def test_launch_returns_in_rank_order():
    assert launch(_rank_id, 3) == [0, 10, 20]


def test_launch_reraises_rank_exception_with_traceback():
    with pytest.raises(KeyError, match="planted failure on rank 1") as info:
        launch(_raise_on_rank, 2, 1)
    assert "traceback of rank 1" in str(info.value.__cause__)
    assert "_raise_on_rank" in str(info.value.__cause__)


def test_launch_reports_a_dead_rank():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1|timed out|Connection|closed"):
        launch(_die_on_rank, 2, 1, dist_timeout_s=10)
    assert time.monotonic() - t0 < 60


def test_missing_peer_raises_after_timeout_instead_of_hanging():
    t0 = time.monotonic()
    with pytest.raises(Exception):
        launch(_hang_on_rank, 2, 1, dist_timeout_s=3, timeout_s=40)
    assert time.monotonic() - t0 < 45


def test_launch_starts_again_on_another_port_when_theirs_was_taken(busy_port):
    """The rendezvous port is picked free, then bound by rank 0's store a moment later; a process that
    took it meanwhile made ``launch`` raise ``DistNetworkError ... EADDRINUSE`` with nothing wrong in the
    call. The ranks now start again on a newly picked port (as ``MultiprocExecutor``'s do), at most
    ``PORT_ATTEMPTS`` times."""
    from mtpspec.distributed import launcher
    busy_port.first()
    assert launch(_rank_id, 2) == [0, 10] and len(busy_port.picks) == 2
    busy_port.picks.clear()
    busy_port.always()
    with pytest.raises(Exception) as info:
        launch(_rank_id, 2)
    assert launcher.port_taken(f"{info.value}\n{info.value.__cause__}"), info.value
    assert len(busy_port.picks) == launcher.PORT_ATTEMPTS


def test_start_on_free_port_starts_again_only_while_the_port_was_taken():
    """The loop ``launch`` and ``MultiprocExecutor`` share: a newly picked port per start, again only for an error
    ``taken`` accepts (never past ``PORT_ATTEMPTS`` starts: a taken port, or the gloo mesh failing inside
    ``init_process_group``, a flake seen once under load); any other error, ``KeyboardInterrupt`` included,
    is raised at once."""
    from mtpspec.distributed import launcher
    ports = []

    def start(fails, error):
        def run(port):
            ports.append(port)
            if len(ports) <= fails:
                raise error
            return port
        return run

    taken = lambda exc: isinstance(exc, RuntimeError) and launcher.restartable(str(exc))  # noqa: E731
    assert launcher.start_on_free_port(start(1, RuntimeError("EADDRINUSE")), taken) == ports[-1]
    assert len(ports) == 2
    mesh = RuntimeError("Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer [127.0.0.1]:45230\n"
                        "  File \"distributed_c10d.py\", line 1899, in init_process_group")
    for fails, error, starts in [(99, RuntimeError("address already in use"), launcher.PORT_ATTEMPTS),
                                 (1, mesh, 2),  # the mesh failed while the ranks rendezvoused: started again
                                 # ... but not once a collective of the caller's code has run
                                 (99, RuntimeError("Gloo connectFullMesh failed"), 1),
                                 (99, RuntimeError("another error"), 1), (99, ValueError("EADDRINUSE"), 1),
                                 (99, KeyboardInterrupt(), 1)]:
        ports.clear()
        if fails < starts:
            assert launcher.start_on_free_port(start(fails, error), taken) == ports[-1] and len(ports) == starts
            continue
        with pytest.raises(type(error)) as info:
            launcher.start_on_free_port(start(fails, error), taken)
        assert info.value is error and len(ports) == starts, (error, ports)


def test_runs_under_torchrun(tmp_path):
    script = tmp_path / "tr.py"
    script.write_text(textwrap.dedent("""
        import torch
        from mtpspec.distributed import (init_distributed_environment, get_tensor_model_parallel_rank,
                                         get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce)
        init_distributed_environment(backend="gloo")
        r = get_tensor_model_parallel_rank()
        s = tensor_model_parallel_all_reduce(torch.tensor([float(r + 1)]))
        print(f"rank={r} world={get_tensor_model_parallel_world_size()} sum={s.item():.0f}")
    """))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(__import__("mtpspec.distributed.launcher", fromlist=["x"]).find_free_port()),
                           str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rank=0 world=2 sum=3" in proc.stdout and "rank=1 world=2 sum=3" in proc.stdout


def test_single_process_defaults():
    assert get_tensor_model_parallel_world_size() == 1
    x = torch.randn(3, 2)
    assert tensor_model_parallel_all_reduce(x) is x
    assert sp_shard(x) is x

"""Vocab-parallel Gumbel-max sampling (mtpspec/sample/gumbel.py): the device hash equals the host
counter hash, draws follow softmax(l / T) (chi-square, as tests/test_rejection_sampler.py), the
reported q(x) is the gathered softmax's, and shards of any tp size give bit-identical tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtpspec.sample import gumbel as gm
from mtpspec.sample.counter_rng import counter_uniforms, seed_to_u64, splitmix64
from tests.test_rejection_sampler import P_VALUE_FLOOR, chi_square_p_value


def _as_i64(u: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(u.astype(np.uint64).view(np.int64).copy())


def test_device_hash_equals_host_hash() -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**63, size=1000, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    assert torch.equal(gm.splitmix64_t(_as_i64(x)), _as_i64(splitmix64(x)))
    keys = [seed_to_u64(s) for s in (0, 1, -5, 2**70 + 3)]
    pos = np.array([[0], [7], [123456], [2**40]], dtype=np.int64)
    h = gm.row_hash(_as_i64(np.array(keys, dtype=np.uint64)), torch.from_numpy(pos[:, 0]), 1)
    u = gm._lsr(h, 11).double() * 2.0 ** -53
    assert torch.equal(u, torch.from_numpy(counter_uniforms(keys, pos, 1)[:, 0]))


def _shards(logits: torch.Tensor, tp: int, vocab: int):
    """(local logits, vocab_start, num_real) of each rank, padded to 4 columns per rank multiple."""
    per = -(-vocab // (4 * tp)) * 4
    pad = torch.cat([logits, torch.full((logits.shape[0], per * tp - vocab), 99.0)], dim=1)  # padding must never win
    return [(pad[:, r * per:(r + 1) * per], r * per, max(0, min(vocab - r * per, per))) for r in range(tp)]


def _sample(logits, temp, rows, tp):
    vocab = logits.shape[1]
    packed = [gm.local_gumbel_top(loc, start, nr, temp, rows) for loc, start, nr in _shards(logits, tp, vocab)]
    return gm.pick_gumbel(torch.stack(packed))


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_law_q_and_tp_invariance(temperature: float) -> None:
    torch.manual_seed(0)
    vocab, n = 13, 20000
    logits = (torch.randn(vocab) * 1.5).expand(n, vocab).contiguous()
    temp = torch.full((n,), temperature)
    rows = gm.row_hash(torch.full((n,), 12345, dtype=torch.int64), torch.arange(n), gm.STREAM_DRAFT)
    ref = _sample(logits, temp, rows, 1)
    probs = torch.softmax(logits[0].double() / temperature, -1).numpy()
    counts = np.bincount(ref.token_ids.numpy(), minlength=vocab)
    assert chi_square_p_value(counts, probs) > P_VALUE_FLOOR
    want = torch.log_softmax(logits.double() / temperature, -1).gather(1, ref.token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(ref.log_q.double(), want, atol=1e-5, rtol=0)
    for tp in (2, 3, 4):
        got = _sample(logits, temp, rows, tp)
        assert torch.equal(got.token_ids, ref.token_ids)
        torch.testing.assert_close(got.log_q, ref.log_q, atol=1e-5, rtol=0)


def test_wrong_law_is_detected() -> None:
    vocab, n = 13, 20000
    logits = torch.linspace(-2, 2, vocab).expand(n, vocab).contiguous()
    rows = gm.row_hash(torch.zeros(n, dtype=torch.int64), torch.arange(n), gm.STREAM_DRAFT)
    got = _sample(logits, torch.full((n,), 1.0), rows, 2)
    probs = torch.softmax(logits[0].double() / 0.8, -1).numpy()  # not the law drawn from
    assert chi_square_p_value(np.bincount(got.token_ids.numpy(), minlength=vocab), probs) < P_VALUE_FLOOR


def test_greedy_rows_are_torch_argmax() -> None:
    vocab = 10
    logits = torch.randn(6, vocab)
    logits[1, 3] = logits[1, 7] = 50.0       # tie across a shard boundary at tp 2 (per rank 8)
    logits[2, 8] = logits[2, 9] = 50.0       # tie inside the last shard
    logits[3] = float("-inf")                # all -inf: first id
    logits[4, 9] = float("nan")              # NaN counts as the maximum
    logits[5, 2] = logits[5, 5] = float("nan")
    temp = torch.zeros(6)
    rows = torch.arange(6, dtype=torch.int64)
    for tp in (1, 2, 3):
        assert torch.equal(_sample(logits, temp, rows, tp).token_ids, logits.argmax(-1)), tp


def test_mixed_rows_and_seeded_reproducibility_across_batch_positions() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 37)
    temp = torch.tensor([1.0, 0.0, 0.7, 1.0])
    keys = torch.tensor([5, 6, 7, 8], dtype=torch.int64)
    pos = torch.tensor([10, 11, 12, 13])
    a = _sample(logits, temp, gm.row_hash(keys, pos, gm.STREAM_DRAFT), 2)
    perm = torch.tensor([2, 0, 3, 1])
    b = _sample(logits[perm], temp[perm], gm.row_hash(keys[perm], pos[perm], gm.STREAM_DRAFT), 1)
    assert torch.equal(b.token_ids, a.token_ids[perm])
    assert a.token_ids[1] == logits[1].argmax()


def test_vocab_parallel_gumbel_sample_single_process() -> None:
    logits = torch.randn(3, 20)
    temp = torch.tensor([1.0, 0.0, 2.0])
    rows = torch.tensor([1, 2, 3], dtype=torch.int64)
    got = gm.vocab_parallel_gumbel_sample(logits, 0, 20, temp, rows)
    assert torch.equal(got.token_ids, _sample(logits, temp, rows, 1).token_ids)


def _bytes_rank(vocab: int, hidden: int, seqs: int):
    from mtpspec.distributed import comm_stats, reset_comm_stats
    from mtpspec.layers.logits_processor import LogitsProcessor
    from mtpspec.layers.vocab_parallel_embedding import ParallelLMHead
    g = torch.Generator().manual_seed(0)
    head = ParallelLMHead(vocab, hidden, params_dtype=torch.bfloat16)
    head.weight.weight_loader(head.weight, torch.randn(vocab, hidden, generator=g))
    h = torch.randn(seqs, hidden, generator=g).bfloat16()
    lp = LogitsProcessor(vocab)
    temp = torch.tensor([1.0, 0.0, 0.5] * (seqs // 3) + [1.0] * (seqs % 3))
    rows = gm.row_hash(torch.arange(seqs, dtype=torch.int64), torch.full((seqs,), 3), gm.STREAM_DRAFT)
    reset_comm_stats()
    full = lp.compute_logits(head, h)
    s_full = comm_stats()
    reset_comm_stats()
    pick, local = lp.get_sampled_tokens(head, h, temp, rows)
    ref = gm.pick_gumbel(gm.local_gumbel_top(full, 0, vocab, temp, rows).unsqueeze(0))
    return s_full, comm_stats(), pick, ref, local.shape


def test_get_sampled_tokens_on_two_ranks_bytes_and_tp1_equality() -> None:
    """tp 2 (gloo): ids bit-identical to the tp-1 draw from the gathered logits, log q within
    rounding, one [N, 4] float32 gather under its own counter (benchmarks/draft_sampling_bytes.py
    prints the same at tp 8: 0.04% of the full-logits gather at GLM-5's vocab)."""
    from mtpspec.distributed import launch
    vocab, seqs = 154880, 64
    res = launch(_bytes_rank, 2, vocab, 16, seqs, timeout_s=300)
    for s_full, s_samp, pick, ref, shape in res:
        assert shape == (seqs, 77440)
        assert torch.equal(pick.token_ids, ref.token_ids)
        torch.testing.assert_close(pick.log_q, ref.log_q, atol=1e-4, rtol=0)
        assert set(s_samp) == {"all_gather_draft_sample"}
        assert s_samp["all_gather_draft_sample"]["bytes_sent"] == seqs * gm.PACKED_BYTES_PER_ROW
        assert s_samp["all_gather_draft_sample"]["bytes_sent"] / s_full["all_gather"]["bytes_sent"] < 2e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_equals_reference(interp, dtype) -> None:
    """The one-pass kernel (interpreter) against the torch reference: same ids and chosen logits,
    log-sum-exp within rounding; rows long enough to split into chunks, -inf rows, greedy rows,
    a padded shard (num_real < per_rank) with a column stride."""
    torch.manual_seed(3)
    n, per = 5, 9000
    logits = (torch.randn(n, per + 7) * 3).to(dtype)
    logits[2] = float("-inf")
    logits[3, 100] = 40.0
    local = logits[:, :per]  # row stride per + 7
    temp = torch.tensor([1.0, 0.5, 1.0, 0.0, 2.0])
    rows = gm.row_hash(torch.arange(n, dtype=torch.int64) * 11, torch.arange(n) + 5, gm.STREAM_DRAFT)
    for num_real in (per, per - 1000, 1):
        got = gm.local_gumbel_top(local, 4096, num_real, temp, rows)
        ref = gm.local_gumbel_top_ref(local, 4096, num_real, temp, rows)
        assert torch.equal(got[:, 1].view(torch.int32), ref[:, 1].view(torch.int32)), num_real
        torch.testing.assert_close(got[:, [0, 3]], ref[:, [0, 3]], atol=0, rtol=0)
        torch.testing.assert_close(got[:, 2], ref[:, 2], atol=1e-4, rtol=1e-5)


def _torch_combine(part: torch.Tensor, part_idx: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """The torch combine of the chunk partials that the combine kernels replaced (bit reference)."""
    score = part[..., 0]
    first = torch.where(torch.isnan(score), torch.full_like(score, float("inf")), score).argmax(dim=1, keepdim=True)
    top = part.gather(1, first.unsqueeze(-1).expand(-1, 1, 3)).squeeze(1)
    gid = (part_idx.gather(1, first).squeeze(1) + vocab_start).view(torch.float32)
    return torch.stack([top[:, 0], gid, torch.logsumexp(part[..., 2], dim=1), top[:, 1]], dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_kernels_hashed_rows_and_tp1_pick_are_bit_exact(interp, dtype) -> None:
    """The combine kernels equal the torch combine bit for bit (NaN / +inf / -inf chunks), rows
    hashed in the kernel (NoiseRows, 64-bit keys and positions) equal row_hash's, and the fused
    tp-1 pick written into strided buffers equals pick_gumbel of the packed row bit for bit."""
    from mtpspec.ops.gumbel_top import gumbel_chunk_partials
    torch.manual_seed(4)
    n, per = 6, 9000
    x = (torch.randn(n, per) * 3).to(dtype)
    x[1] = float("-inf")
    x[2, 7000] = float("nan")
    x[3, 8000] = float("inf")
    x[4, 10] = float("inf")
    x[4, 8500] = float("nan")
    temp = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 2.0])
    keys = torch.tensor([2**63 - 1, -2**63, -1, 0, 12345, 2**40 + 7], dtype=torch.int64)
    base = torch.tensor([0, 2**62 - 3, 5, 2**35, 77, 3], dtype=torch.int64)
    rows = gm.NoiseRows(keys, base, 3, gm.STREAM_DRAFT)
    hashes = gm.row_hash(keys, base + 3, gm.STREAM_DRAFT)
    assert torch.equal(rows.hashes(), hashes)
    for num_real in (per, 5000, 1):
        part, part_idx = gumbel_chunk_partials(x, 100, num_real, temp, rows)
        assert part.shape[1] == (2 if num_real > 4096 else 1)  # 4 interpreter SMs: the split is exercised
        part_h = gumbel_chunk_partials(x, 100, num_real, temp, hashes)[0]
        assert torch.equal(part.view(torch.int32), part_h.view(torch.int32))
        packed = gm.local_gumbel_top(x, 100, num_real, temp, rows)
        assert torch.equal(packed.view(torch.int32), _torch_combine(part, part_idx, 100).view(torch.int32))
        want = gm.pick_gumbel(packed.unsqueeze(0))
        buf = torch.zeros(2, n, 3)
        out = gm.GumbelPick(torch.empty(n, dtype=torch.int64), buf[0, :, 1], buf[1, :, 2])
        got = gm.vocab_parallel_gumbel_sample(x, 100, num_real, temp, rows, out=out)
        assert got is out and torch.equal(got.token_ids, want.token_ids)
        assert torch.equal(got.log_q.view(torch.int32), want.log_q.view(torch.int32))
        assert torch.equal(got.lse.view(torch.int32), want.lse.view(torch.int32))
        assert torch.equal(buf[:, :, 0], torch.zeros(2, n))  # nothing else written


def test_get_sampled_tokens_into_buffers_is_bit_exact(interp) -> None:
    """logits_out / out (the proposer's persistent buffers) give the same logits, ids, log q and
    LSE bits as the plain call."""
    from mtpspec.layers.logits_processor import LogitsProcessor
    from mtpspec.layers.vocab_parallel_embedding import ParallelLMHead
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        head = ParallelLMHead(5000, 32, params_dtype=dtype)
        head.weight.weight_loader(head.weight, torch.randn(5000, 32, generator=g))
        h = torch.randn(5, 32, generator=g).to(dtype)
        lp = LogitsProcessor(4999)
        temp = torch.tensor([1.0, 0.0, 0.5, 1.0, 2.0])
        rows = gm.NoiseRows(torch.arange(5) * 7, torch.arange(5) + 40, 2, gm.STREAM_DRAFT)
        want, want_local = lp.get_sampled_tokens(head, h, temp, rows.hashes())
        logits = torch.zeros(2, 7, head.weight.shape[0], dtype=dtype)
        lq, lse = torch.zeros(7, 2), torch.zeros(7, 2)
        out = gm.GumbelPick(torch.empty(5, dtype=torch.int64), lq[:5, 1], lse[:5, 1])
        got, local = lp.get_sampled_tokens(head, h, temp, rows, out=out, logits_out=logits[1, :5])
        assert local.data_ptr() == logits[1, :5].data_ptr() and torch.equal(local, want_local)
        assert torch.equal(got.token_ids, want.token_ids)
        assert torch.equal(lq[:5, 1].view(torch.int32), want.log_q.view(torch.int32))
        assert torch.equal(lse[:5, 1].view(torch.int32), want.lse.view(torch.int32))


def test_gumbel_kernels_compile_for_hopper() -> None:
    """The chunk, shift and combine kernels compile ahead of time for sm_90 (the interpreter does
    not check Triton's typing rules: a compiled-only error once broke every sampled draft on a GPU)."""
    from mtpspec.ops import triton_utils
    i32 = lambda names: {n: "i32" for n in names}  # noqa: E731
    chunk_sig = {"x_ptr": "*bf16", "t_ptr": "*fp32", "rows_ptr": "*i64", "keys_ptr": "*i64", "pos_ptr": "*i64",
                 "pos_add": "i64", "part_ptr": "*fp32", "part_idx_ptr": "*i32",
                 **i32(["n_real", "chunk", "n_chunks", "stride_row", "vocab_start"])}
    specs = [{"module": "mtpspec.ops.gumbel_top", "kernel": "_gumbel_chunk", "signature": chunk_sig,
              "constexprs": dict(BLOCK=2048, BF16_BY_BITS=False, HASH_ROWS=hashed),
              "aligned": ["x_ptr", "part_ptr", "part_idx_ptr"], "num_warps": 8} for hashed in (False, True)]
    specs.append({"module": "mtpspec.ops.gumbel_top", "kernel": "_lse_shift",
                  "signature": {"part_ptr": "*fp32", "max_ptr": "*fp32", "shifted_ptr": "*fp32", "n_chunks": "i32"},
                  "constexprs": dict(BLOCK_C=8), "aligned": [], "num_warps": 1})
    comb_sig = {"part_ptr": "*fp32", "part_idx_ptr": "*i32", "logsum_ptr": "*fp32", "max_ptr": "*fp32",
                "packed_ptr": "*fp32", "packed_i32_ptr": "*i32", "ids_ptr": "*i64", "log_q_ptr": "*fp32",
                "lse_ptr": "*fp32", **i32(["n_chunks", "vocab_start", "stride_log_q", "stride_lse"])}
    specs += [{"module": "mtpspec.ops.gumbel_top", "kernel": "_gumbel_combine", "signature": comb_sig,
               "constexprs": dict(FINAL=final, BLOCK_C=8), "aligned": [], "num_warps": 1} for final in (False, True)]
    assert len(triton_utils.compile_reports(specs)) == len(specs)

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

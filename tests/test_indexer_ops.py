"""The DSA lightning indexer ops: key-cache write, logits (Triton kernel under the interpreter and
the torch reference) against a float64 brute force in python loops and against transformers'
DeepseekV32Indexer scores, top-k with ties to the lower position, and the whole selection chain
(logits -> top-k -> slots -> sparse MLA) against a brute-force masked dense softmax."""

from __future__ import annotations

import math

import pytest
import torch

from mtpspec.ops.indexer import (indexer_k_cache_write, indexer_k_cache_write_ref, indexer_logits, indexer_logits_ref,
                                 indexer_topk)

BS = 8


class Batch:
    """A paged varlen batch: sequences with ``q_lens`` new rows of ``s_lens`` tokens, shuffled
    block tables (``-1`` padded), one graph padding row past the real ones and one padding
    sequence (``seq_len`` 0); ``max_seq_len`` is a loose bound (+ 5)."""

    def __init__(self, q_lens, s_lens, heads, dim, dtype, seed=0, values="normal") -> None:
        g = torch.Generator().manual_seed(seed)
        self.q_lens, self.s_lens = list(q_lens), list(s_lens)
        need = [-(-s // BS) for s in s_lens]
        nb = sum(need) + 2
        perm = torch.randperm(nb, generator=g).tolist()
        self.bt = torch.full((len(s_lens) + 1, max(need) + 1), -1, dtype=torch.int32)
        k = 0
        for i, n in enumerate(need):
            self.bt[i, :n] = torch.tensor(perm[k:k + n])
            k += n
        t = sum(q_lens)
        self.t = t
        self.qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist() + [t], dtype=torch.int32)
        self.seq_lens = torch.tensor(self.s_lens + [0], dtype=torch.int32)
        self.max_q, self.max_s = max(q_lens), max(s_lens) + 5
        if values == "ints":  # small integers and dyadic weights: every logit exact in fp32 and bf16
            draw = lambda *shape: torch.randint(-2, 3, shape, generator=g).float()  # noqa: E731
            self.w = torch.randint(-3, 4, (t + 1, heads), generator=g).float() / 4
        else:
            draw = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
            self.w = torch.randn(t + 1, heads, generator=g)
        self.cache = draw(nb, BS, dim).to(dtype)
        self.q = draw(t + 1, heads, dim).to(dtype)
        # each real row: (its sequence, its position)
        self.rows = [(i, s - q + j) for i, (q, s) in enumerate(zip(q_lens, s_lens)) for j in range(q)]

    def meta(self):
        return self.qsl, self.seq_lens, self.bt, self.max_q, self.max_s

    def key(self, i: int, s: int) -> torch.Tensor:
        return self.cache[self.bt[i, s // BS], s % BS]

    def brute_force(self) -> torch.Tensor:
        out = torch.full((self.t + 1, self.max_s), float("-inf"), dtype=torch.float64)
        for r, (i, p) in enumerate(self.rows):
            for s in range(p + 1):
                dots = self.q[r].double() @ self.key(i, s).double()
                out[r, s] = (self.w[r].double() * dots.clamp(min=0)).sum()
        return out


# mixed: prefill of 5, decode at a block boundary, 1 + 3 verification rows across blocks, a short decode
MIXED = ([5, 1, 4, 1], [5, 16, 29, 2])


@pytest.mark.parametrize("heads", [6, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["interp", "no_interp"])
def test_logits_match_brute_force(request, path, dtype, heads) -> None:
    request.getfixturevalue(path)
    b = Batch(*MIXED, heads, 32, dtype, seed=heads)
    got = indexer_logits(b.q, b.w, b.cache, *b.meta(), block_n=16, keys_per_program=16)
    want = b.brute_force()
    assert got.shape == (b.t + 1, b.max_s) and got.dtype == torch.float32
    inf = torch.isinf(want)
    assert torch.equal(torch.isinf(got), inf) and bool((got[inf] < 0).all()), "-inf exactly outside the context"
    torch.testing.assert_close(got[~inf].double(), want[~inf], atol=1e-4, rtol=1e-5)
    assert torch.isinf(got[-1]).all(), "the padding row is all -inf"


def test_kernel_equals_reference_on_exact_values(interp) -> None:
    """With integer-valued queries / keys and dyadic weights every logit is exact, so the kernel
    (several key chunks per row, tiles crossing cache blocks) and the reference agree bit for bit."""
    b = Batch(*MIXED, 6, 32, torch.bfloat16, seed=3, values="ints")
    got = indexer_logits(b.q, b.w, b.cache, *b.meta(), block_n=16, keys_per_program=32)
    ref = indexer_logits_ref(b.q, b.w, b.cache, *b.meta())
    assert torch.equal(got, ref) and torch.equal(got.double(), b.brute_force())


def test_logits_match_transformers_indexer_scores(interp) -> None:
    """transformers' DeepseekV32Indexer: ``sum_h (weights_proj(x)_h * n_heads**-0.5) *
    relu(q_h . k * head_dim**-0.5)``; our op with both factors folded into the weights gives the
    same scores (recorded where transformers calls topk; identity rope, which is the layer's
    business, keeps the test on the score formula)."""
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer
    nh, d = 4, 32
    cfg = DeepseekV32Config(hidden_size=32, q_lora_rank=16, index_n_heads=nh, index_head_dim=d, qk_rope_head_dim=8,
                            index_topk=6, num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8)
    torch.manual_seed(0)
    m = DeepseekV32Indexer(cfg, 0).eval()
    s = 11
    h, q_resid = torch.randn(1, s, 32), torch.randn(1, s, 16)
    ones, zeros = torch.ones(1, s, 8), torch.zeros(1, s, 8)
    seen = []
    topk = torch.Tensor.topk
    try:
        torch.Tensor.topk = lambda self, *a, **k: (seen.append(self.clone()), topk(self, *a, **k))[1]
        m(h, q_resid, (ones, zeros), torch.ones(s, s, dtype=torch.bool).tril()[None], None)
    finally:
        torch.Tensor.topk = topk
    with torch.no_grad():
        q = m.wq_b(q_resid[0]).view(s, nh, d)
        k = m.k_norm(m.wk(h[0]))
        w = m.weights_proj(h[0]).float() * nh ** -0.5 * d ** -0.5
        cache = torch.zeros(2, BS, d)
        indexer_k_cache_write(k, cache, torch.arange(s))
        got = indexer_logits(q, w, cache, torch.tensor([0, s]), torch.tensor([s]), torch.tensor([[0, 1]]), s, s)
    torch.testing.assert_close(got, seen[0][0], atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------ top-k
def python_topk(row, k):
    """Finite entries sorted by (value desc, position asc), the first k, ascending, -1 padded."""
    cand = sorted((-v, p) for p, v in enumerate(row) if math.isfinite(v))
    pos = sorted(p for _, p in cand[:k])
    return pos + [-1] * (k - len(pos))


def test_topk_ties_at_the_boundary_go_to_lower_positions() -> None:
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([
        [1.0, 3.0, 2.0, 2.0, 2.0, 0.5, 2.0, -inf],  # 3 then four 2.0s: positions 2, 3 win
        [0.0, -0.0, 0.0, -0.0, 5.0, -1.0, -inf, -inf],  # -0.0 ties with +0.0
        [-inf, nan, inf, 7.0, -inf, -inf, -inf, -inf],  # only the finite 7.0 counts
        [-inf] * 8,  # a padding row
        [-2.0, -1.0, -3.0, -1.0, -1.0, -inf, -inf, -inf]])
    got = indexer_topk(logits, 3)
    assert got.dtype == torch.int32
    assert got.tolist() == [[1, 2, 3], [0, 1, 4], [3, -1, -1], [-1, -1, -1], [1, 3, 4]]
    assert indexer_topk(logits, 10)[0].tolist() == [0, 1, 2, 3, 4, 5, 6, -1, -1, -1]  # index_topk > S


@pytest.mark.parametrize("k", [1, 5, 17, 40])
def test_topk_matches_python_on_many_ties(k) -> None:
    g = torch.Generator().manual_seed(k)
    logits = torch.randint(-3, 4, (6, 33), generator=g).float() / 2  # many equal values
    logits[torch.rand(6, 33, generator=g) < 0.3] = float("-inf")
    logits[2, 20:] = float("-inf")
    got = indexer_topk(logits, k)
    assert got.tolist() == [python_topk(r, k) for r in logits.tolist()]


def test_selection_chain_matches_brute_force(interp) -> None:
    """logits -> top-k -> slots -> sparse MLA == a dense float64 softmax masked (in python) to
    the brute-force top-k of each row's causal context; each verification row has its own
    selection, which prunes (index_topk 6 < context)."""
    from mtpspec.ops.sparse_mla_attention import positions_to_slots, sparse_mla_attention
    b = Batch(*MIXED, 4, 16, torch.float32, seed=7, values="ints")
    topk = 6
    pos = indexer_topk(indexer_logits(b.q, b.w, b.cache, *b.meta(), block_n=16, keys_per_program=16), topk)
    want_pos = [python_topk(r, topk) for r in b.brute_force().tolist()]
    assert pos.tolist() == want_pos
    assert len({tuple(want_pos[r]) for r in range(6, 10)}) > 1, "verification rows select differently"
    seq_idx = torch.tensor([i for i, _ in b.rows] + [len(b.s_lens)], dtype=torch.int32)
    slots = positions_to_slots(pos, seq_idx, b.bt, BS)
    g = torch.Generator().manual_seed(8)
    heads, r, rope = 6, 16, 16
    latent = torch.randn(b.cache.shape[0], BS, r + rope, generator=g)
    ql, qp = torch.randn(b.t + 1, heads, r, generator=g), torch.randn(b.t + 1, heads, rope, generator=g)
    o = sparse_mla_attention(ql, qp, latent, slots, 0.2, block_n=16)
    for row, (i, p) in enumerate(b.rows + [(len(b.s_lens), -1)]):
        for h in range(heads):
            keys = torch.stack([latent[b.bt[i, s // BS], s % BS] for s in range(p + 1)]).double() if p >= 0 else None
            if keys is None:
                assert o[row].abs().max() == 0
                continue
            sc = keys @ torch.cat([ql[row, h], qp[row, h]]).double() * 0.2
            mask = torch.tensor([s in want_pos[row] for s in range(p + 1)])
            prob = torch.softmax(sc.masked_fill(~mask, float("-inf")), 0)
            torch.testing.assert_close(o[row, h].double(), prob @ keys[:, :r], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ key write
@pytest.mark.parametrize("path", ["interp", "no_interp"])
@pytest.mark.parametrize("src_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                   (torch.bfloat16, torch.bfloat16)])
def test_k_cache_write(request, path, src_dtype, cache_dtype) -> None:
    request.getfixturevalue(path)
    g = torch.Generator().manual_seed(11)
    d, nb = 24, 3
    k = torch.randn(5, d, generator=g).to(src_dtype)
    slots = torch.tensor([17, -1, 0, 8, -1], dtype=torch.int32)
    cache = torch.full((nb, BS, d), 7.0, dtype=cache_dtype)
    indexer_k_cache_write(k, cache, slots)
    flat = cache.view(-1, d)
    for row, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], k[row].float().to(cache_dtype))  # round to nearest even
    untouched = torch.ones(nb * BS, dtype=torch.bool)
    untouched[[17, 0, 8]] = False
    assert torch.all(flat[untouched] == 7.0)
    indexer_k_cache_write(k[:0], cache, slots[:0])
    indexer_k_cache_write_ref(k[:2], cache, torch.tensor([-1, -1]))  # no valid row: slot 0 rewritten as it was
    assert torch.equal(flat[0], k[2].float().to(cache_dtype))


# ------------------------------------------------------------------------------------------ checks / sync
def test_no_host_sync(interp) -> None:
    from test_paged_attention import no_host_sync
    b = Batch(*MIXED, 6, 32, torch.float32, seed=9)
    with torch.no_grad(), no_host_sync():
        indexer_k_cache_write(b.q[:3, 0], b.cache, torch.tensor([3, -1, 9]))
        logits = indexer_logits(b.q, b.w, b.cache, *b.meta())
        indexer_logits_ref(b.q, b.w, b.cache, *b.meta())
        indexer_topk(logits, 4)


def test_bad_inputs_raise() -> None:
    b = Batch(*MIXED, 6, 32, torch.float32)
    meta = b.meta()
    with pytest.raises(TypeError, match="weights must be float32"):
        indexer_logits(b.q, b.w.half(), b.cache, *meta)
    with pytest.raises(ValueError, match="weights"):
        indexer_logits(b.q, b.w[:, :5], b.cache, *meta)
    with pytest.raises(ValueError, match="k_cache must be"):
        indexer_logits(b.q, b.w, b.cache[..., :16], *meta)
    with pytest.raises(TypeError, match="share one of"):
        indexer_logits(b.q, b.w, b.cache.bfloat16(), *meta)
    with pytest.raises(ValueError, match="max_seq_len must be"):
        indexer_logits(b.q, b.w, b.cache, *meta[:4], -1)
    with pytest.raises(ValueError, match="seq_lens must be"):
        indexer_logits(b.q, b.w, b.cache, meta[0], meta[1][:2], *meta[2:])
    with pytest.raises(ValueError, match="index_topk must be"):
        indexer_topk(torch.zeros(2, 3), 0)
    with pytest.raises(TypeError, match="logits must be float32"):
        indexer_topk(torch.zeros(2, 3, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="do not fit"):
        indexer_k_cache_write(torch.zeros(3, 16), b.cache, torch.zeros(3, dtype=torch.int32))

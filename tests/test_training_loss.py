"""MTP training loss: index alignment against a brute-force per-token loop (DeepSeek-V3 eqs. 21-25)."""

import math

import pytest
import torch

from mtpspec.training.mtp_loss import (IGNORE_INDEX, doc_end_from_cu_seqlens, mtp_training_loss,
                                       positions_from_cu_seqlens, shifted)

V, H = 37, 6


class FakeModel:
    """Row-wise stand-in for the target head and MTP layers, with the position-0 rule."""

    def __init__(self, depths: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
        self.emb, self.head = r(V, H), r(H, V)
        self.a = [r(H, H) for _ in range(depths)]
        self.b = [r(H, H) for _ in range(depths)]
        self.heads = [r(H, V) for _ in range(depths)]

    def mtp_row(self, tok: int, pos: int, prev: torch.Tensor, k: int) -> torch.Tensor:
        e = torch.zeros(H, dtype=torch.float64) if pos == 0 else self.emb[tok]
        return torch.tanh(e @ self.a[k] + prev @ self.b[k])

    def mtp_forward(self, ids, positions, prev, k):
        e = self.emb[ids] * (positions != 0).unsqueeze(-1)
        return torch.tanh(e @ self.a[k] + prev @ self.b[k])

    def logits(self, h, k):
        return h @ (self.head if k is None else self.heads[k])


def _brute(model, docs, hidden_docs, depths, lam, alpha=0.0, starts=None):
    """Loop over documents and positions, indexing tokens explicitly. ``alpha``: self-distillation
    weight; the teacher of depth k at row i is softmax of the target head at row i + k. ``starts``:
    per document, the first position i whose losses count."""
    sums, counts = [0.0] * (depths + 1), [0] * (depths + 1)
    for d, (doc, hid) in enumerate(zip(docs, hidden_docs)):
        for i in range(starts[d] if starts else 0, len(doc)):
            prev = hid[i]
            if i + 1 < len(doc):
                lp = torch.log_softmax(model.logits(prev, None), -1)
                sums[0] -= lp[doc[i + 1]].item()
                counts[0] += 1
            for k in range(1, depths + 1):
                if i + k >= len(doc):
                    break
                prev = model.mtp_row(doc[i + k], i + k - 1, prev, k - 1)  # depth k at position i + k - 1
                if i + k + 1 < len(doc):
                    lp = torch.log_softmax(model.logits(prev, k - 1), -1)
                    teacher = torch.softmax(model.logits(hid[i + k], None), -1)
                    sums[k] -= (1 - alpha) * lp[doc[i + k + 1]].item() + alpha * (teacher * lp).sum().item()
                    counts[k] += 1
    means = [s / c if c else 0.0 for s, c in zip(sums, counts)]
    total = means[0] + (lam / depths * sum(means[1:]) if depths else 0.0)
    return total, means, counts


@pytest.mark.parametrize("depths", [0, 1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("alpha", [0.0, 0.4, 1.0])
def test_loss_matches_brute_force(depths, seed, alpha):
    g = torch.Generator().manual_seed(100 + seed)
    lens = [1, 2, 3, 7, 4, 12, 5] if seed == 0 else [int(x) for x in torch.randint(1, 15, (9,), generator=g)]
    docs = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
    model = FakeModel(max(depths, 1), seed)
    hidden = torch.randn(sum(lens), H, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    ids = torch.tensor([t for d in docs for t in d])
    out = mtp_training_loss(ids, positions_from_cu_seqlens(cu), doc_end_from_cu_seqlens(cu), hidden,
                            model.logits, model.mtp_forward, depths, mtp_lambda=0.3, mtp_distill=alpha)
    hidden_docs = torch.split(hidden.detach(), lens)
    total, means, counts = _brute(model, docs, hidden_docs, depths, 0.3, alpha)
    assert out.counts == counts
    assert counts[0] == sum(n - 1 for n in lens)
    assert all(counts[k] == sum(max(n - k - 1, 0) for n in lens) for k in range(depths + 1))
    assert math.isclose(out.target_loss.item(), means[0], rel_tol=1e-12)
    for k in range(depths):
        assert math.isclose(out.mtp_losses[k].item(), means[k + 1], rel_tol=1e-12)
    assert math.isclose(out.loss.item(), total, rel_tol=1e-12)
    out.loss.backward()
    assert torch.isfinite(hidden.grad).all() and hidden.grad.abs().sum() > 0


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_loss_from_leaves_the_positions_before_it_out(alpha):
    """``loss_from`` (a self-distillation document's prompt): the loss equals the brute force over
    positions ``i >= start`` of each document only, at every depth and with distillation."""
    g = torch.Generator().manual_seed(7)
    lens, starts = [9, 1, 12, 5, 7], [3, 0, 11, 0, 6]
    docs = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
    model = FakeModel(3, 2)
    hidden = torch.randn(sum(lens), H, generator=g, dtype=torch.float64)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    ids = torch.tensor([t for d in docs for t in d])
    loss_from = torch.repeat_interleave(cu[:-1] + torch.tensor(starts), torch.tensor(lens))
    out = mtp_training_loss(ids, positions_from_cu_seqlens(cu), doc_end_from_cu_seqlens(cu), hidden,
                            model.logits, model.mtp_forward, 3, mtp_lambda=0.3, mtp_distill=alpha, loss_from=loss_from)
    total, means, counts = _brute(model, docs, torch.split(hidden, lens), 3, 0.3, alpha, starts)
    assert out.counts == counts and counts[0] == sum(max(n - 1 - s, 0) for n, s in zip(lens, starts))
    assert math.isclose(out.loss.item(), total, rel_tol=1e-12)
    full = mtp_training_loss(ids, positions_from_cu_seqlens(cu), doc_end_from_cu_seqlens(cu), hidden,
                             model.logits, model.mtp_forward, 3, mtp_lambda=0.3, mtp_distill=alpha)
    assert full.counts[0] > out.counts[0]  # the mask took rows away


def test_mtp_gradient_reaches_target_hidden_at_row_i():
    # depth-1 loss at row i depends on target hidden i only (and embedding of token i+1).
    model = FakeModel(1, 3)
    ids = torch.tensor([1, 2, 3, 4, 5])
    cu = torch.tensor([0, 5])
    hidden = torch.randn(5, H, dtype=torch.float64, requires_grad=True)
    out = mtp_training_loss(ids, positions_from_cu_seqlens(cu), doc_end_from_cu_seqlens(cu), hidden,
                            model.logits, model.mtp_forward, 1, 1.0)
    (g,) = torch.autograd.grad(out.mtp_losses[0], hidden)
    # rows 0..2 have labels t[2..4]; rows 3, 4 have none
    assert (g[:3].abs().sum(-1) > 0).all() and (g[3:] == 0).all()


def test_distillation_teacher_gets_no_gradient():
    # alpha = 1: the depth-1 loss at row i reads the target at rows i (input) and i + 1 (teacher);
    # the teacher is detached, so row 3 (teacher of row 2 only) gets no gradient.
    model = FakeModel(1, 3)
    ids = torch.tensor([1, 2, 3, 4, 5])
    cu = torch.tensor([0, 5])
    hidden = torch.randn(5, H, dtype=torch.float64, requires_grad=True)
    out = mtp_training_loss(ids, positions_from_cu_seqlens(cu), doc_end_from_cu_seqlens(cu), hidden,
                            model.logits, model.mtp_forward, 1, 1.0, mtp_distill=1.0)
    (g,) = torch.autograd.grad(out.mtp_losses[0], hidden)
    assert (g[:3].abs().sum(-1) > 0).all() and (g[3:] == 0).all()
    # the distilled loss is minimised by the teacher's own distribution: cross-entropy >= entropy
    teacher = torch.softmax(model.logits(hidden.detach()[1:4], None), -1)
    entropy = -(teacher * teacher.log()).sum(-1).mean().item()
    assert out.mtp_losses[0].item() >= entropy - 1e-12


def test_distillation_weight_out_of_range():
    ids, cu = torch.tensor([1, 2, 3]), torch.tensor([0, 3])
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"mtp_distill must be in \[0, 1\], got"):
            mtp_training_loss(ids, positions_from_cu_seqlens(cu), doc_end_from_cu_seqlens(cu), torch.zeros(3, H),
                              FakeModel(1, 0).logits, FakeModel(1, 0).mtp_forward, 1, 1.0, mtp_distill=bad)


def test_position_zero_embedding_is_what_the_model_sees():
    # The loss hands the model the true positions: position 0 of each document.
    seen = {}

    def mtp_forward(ids, positions, prev, k):
        seen[k] = (ids.clone(), positions.clone())
        return prev

    cu = torch.tensor([0, 3, 5])
    ids = torch.tensor([10, 11, 12, 20, 21])
    mtp_training_loss(ids, positions_from_cu_seqlens(cu), doc_end_from_cu_seqlens(cu), torch.zeros(5, 4),
                      lambda h, k: torch.zeros(h.shape[0], 30), mtp_forward, 2, 1.0)
    assert seen[0][1].tolist() == [0, 1, 2, 0, 1]
    assert seen[0][0].tolist() == [11, 12, 0, 21, 0]  # t[i+1] within the document, filler after
    assert seen[1][1].tolist() == [1, 2, 3, 1, 2]  # depth 2: one position further, never 0
    assert seen[1][0].tolist() == [12, 0, 0, 0, 0]


def test_helpers_against_loops():
    lens = [3, 1, 4, 0, 2]
    cu = torch.tensor([0, 3, 4, 8, 8, 10])
    assert doc_end_from_cu_seqlens(cu).tolist() == [3, 3, 3, 4, 8, 8, 8, 8, 10, 10]
    assert positions_from_cu_seqlens(cu).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 0, 1]
    ids = torch.arange(10) + 100
    out, valid = shifted(ids, doc_end_from_cu_seqlens(cu), 2, IGNORE_INDEX)
    assert out.tolist() == [102, -100, -100, -100, 106, 107, -100, -100, -100, -100]
    assert valid.tolist() == [x != -100 for x in out.tolist()]
    with pytest.raises(ValueError, match="starting at 0"):
        doc_end_from_cu_seqlens(torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="non-decreasing"):
        doc_end_from_cu_seqlens(torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match=r"\[N"):
        mtp_training_loss(ids, ids[:3], ids, torch.zeros(10, 2), None, None, 1, 1.0)

"""Verification of draft tokens against the target model: accepted, recovered and bonus tokens.

Random rows use speculative rejection sampling, which emits tokens distributed exactly as the
target distribution ``p`` whatever the draft distribution ``q``:

* Leviathan, Kalman and Matias, "Fast Inference from Transformers via Speculative Decoding"
  (ICML 2023), section 2.3 "Speculative Sampling" and Algorithm 1;
* Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling"
  (2023), section 2, Algorithm 2 "Speculative Sampling (SpS)" and Theorem 1.

For each draft position ``j`` in order: accept draft token ``x`` with probability
``min(1, p_j(x) / q_j(x))`` (here: ``u * q_j(x) < p_j(x)`` with ``u ~ U[0, 1)``); at the first
rejection emit a *recovered* token drawn from ``norm(max(0, p_j - q_j))`` and stop; if all ``k``
drafts are accepted emit a *bonus* token drawn from ``p_k``.

Greedy drafts (the MTP proposer takes the argmax) have a one-hot ``q`` at the draft token:
acceptance probability ``p(x)`` and the residual is ``p`` with ``x`` removed. Pass
``draft_probs=None`` for that case; it is verified by a draw coupled with plain sampling (see
:func:`random_verify`), so seeded tokens do not depend on the drafts.

Sampled drafts (:class:`SampledDrafts`, the MTP proposer's ``draft_sampling="auto"``): the
draft was drawn from ``q = softmax(l / T)`` of the MTP layer's logits ``l`` by vocab-parallel
Gumbel-max (:mod:`mtpspec.sample.gumbel`); the verifier gets ``q(x)`` and the global log-sum-exp
as numbers and ``l`` only as this rank's vocab shard. The accept test reads ``q(x)``; the
residual ``max(0, p - q)`` is formed shard-wise (``p`` is the full target distribution on every
rank) and sampled by vocab-parallel Gumbel-max on ``log max(0, p - q)`` (noise stream
:data:`~mtpspec.sample.gumbel.STREAM_RESIDUAL`), so nothing of vocab size crosses ranks: one
``[B * k, 4]`` float32 gather per step.

Greedy rows (temperature 0) accept drafts up to the first one that differs from the target's
argmax and then emit the target's argmax; when all ``k`` match the target's argmax at position
``k`` is the bonus token. Every row therefore emits ``num_accepted + 1`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from mtpspec.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather
from mtpspec.ops.accept import PLACEHOLDER, greedy_accept
from mtpspec.sample.gumbel import local_gumbel_top, pick_gumbel, scaled_logits
from mtpspec.sample.sampler import SamplingMetadata, compute_probs, sample_inverse_cdf

PLACEHOLDER_TOKEN_ID = PLACEHOLDER  # -1


@dataclass
class RejectionOutput:
    """Result of one verification.

    Attributes:
        output_token_ids: ``[B, k + 1]`` int64: slots ``0 .. num_accepted - 1`` hold the accepted
            drafts, slot ``num_accepted`` the recovered (or bonus) token, later slots
            :data:`PLACEHOLDER_TOKEN_ID`.
        num_accepted: ``[B]`` int64 in ``[0, k]``.
    """

    output_token_ids: torch.Tensor
    num_accepted: torch.Tensor


@dataclass
class SampledDrafts:
    """The draft distributions of sampled drafts, kept vocab-sharded (``B`` decodes, ``k`` drafts).

    Attributes:
        mask: ``[B]`` bool, rows whose drafts were sampled (the others: one-hot ``q``).
        ignore: ``[B]`` bool, rows whose drafts were sampled but whose ``q`` is no longer held
            (the drafts are not verified: nothing is accepted and the row samples plainly).
        local_logits: ``[B, k, per_rank]`` this rank's shard of the draft logits (as drafted).
        vocab_start / num_real: the shard's first global id and real columns.
        temperature: ``[B]`` float32, the temperature the drafts were drawn at.
        log_q: ``[B, k]`` float32, ``log q(draft)``; lse: ``[B, k]`` float32, global
            log-sum-exp of ``l / T``.
        residual_rows: ``[B, k]`` int64 row hashes of the recovered tokens' noise
            (:func:`~mtpspec.sample.gumbel.row_hash` with ``STREAM_RESIDUAL`` at each draft's position).
    """

    mask: torch.Tensor
    ignore: torch.Tensor
    local_logits: torch.Tensor
    vocab_start: int
    num_real: int
    temperature: torch.Tensor
    log_q: torch.Tensor
    lse: torch.Tensor
    residual_rows: torch.Tensor


def residual_local_packed(target_probs: torch.Tensor, d: SampledDrafts) -> torch.Tensor:
    """This rank's packed Gumbel rows ``[B * k, 4]`` for a draw from ``norm(max(0, p - q))``.

    ``target_probs``: ``[B, k, V]`` (full ``p`` of the draft positions). ``q`` on this rank's
    columns is ``exp(l / T - LSE)``; an all-zero residual (``p == q``, where no rejection can
    happen) gives a -inf row, whose pick is never emitted.
    """
    b, k, _ = target_probs.shape
    nr, v0 = d.num_real, d.vocab_start
    if nr <= 0:
        return local_gumbel_top(target_probs.new_zeros(b * k, 0), v0, 0, target_probs.new_ones(b * k),
                                d.residual_rows.reshape(-1))
    x = scaled_logits(d.local_logits[..., :nr].reshape(b * k, nr), d.temperature.repeat_interleave(k))
    q = torch.exp(x - d.lse.reshape(b * k, 1))
    w = (target_probs[..., v0:v0 + nr].reshape(b * k, nr) - q).clamp_min(0.0)
    return local_gumbel_top(torch.log(w), v0, nr, torch.ones(b * k, device=w.device), d.residual_rows.reshape(-1))


def _residual_tokens(target_probs: torch.Tensor, d: SampledDrafts) -> torch.Tensor:
    """``[B, k]`` recovered tokens, one vocab-parallel Gumbel draw per draft position."""
    packed = residual_local_packed(target_probs, d)
    if get_tensor_model_parallel_world_size() > 1:
        packed = tensor_model_parallel_all_gather(packed.unsqueeze(0), dim=0, counter="all_gather_residual_sample")
    else:
        packed = packed.unsqueeze(0)
    return pick_gumbel(packed).token_ids.view(target_probs.shape[:2])


def _leading_true_count(mask: torch.Tensor) -> torch.Tensor:
    """``[B, k]`` bool -> ``[B]`` int64: length of the all-True prefix of each row."""
    return mask.to(torch.int64).cumprod(dim=1).sum(dim=1)


def assemble_output_tokens(drafts: torch.Tensor, final: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """The ``[B, k + 1]`` int64 token block of a verification: slots ``< a``: the accepted drafts
    (``drafts [B, k]``), slot ``a``: ``final[:, a]`` (``final [B, k + 1]``: recovered or bonus token),
    slots ``> a``: :data:`PLACEHOLDER_TOKEN_ID`; ``a = num_accepted [B]`` (int64, ``0 .. k``)."""
    b, k = drafts.shape
    slots = torch.arange(k + 1, device=drafts.device).unsqueeze(0)
    a = num_accepted.unsqueeze(1)
    padded_drafts = torch.cat([drafts, drafts.new_full((b, 1), PLACEHOLDER_TOKEN_ID)], dim=1)
    out = torch.where(slots < a, padded_drafts, final)
    return torch.where(slots <= a, out, torch.full_like(out, PLACEHOLDER_TOKEN_ID))


def _residual_weights(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                      draft_probs: Optional[torch.Tensor]) -> torch.Tensor:
    """``max(0, p - q)`` per draft position, ``[B, k, V]`` (unnormalised).

    With ``draft_probs=None`` (one-hot ``q`` at the draft token) this is ``p`` with the draft
    token's entry set to 0. Rows whose residual is all zero (``p == q``; a rejection is then
    impossible) fall back to ``p`` so the draw stays well defined.
    """
    if draft_probs is None:
        residual = target_probs.scatter(-1, draft_token_ids.unsqueeze(-1), 0.0)
    else:
        residual = (target_probs - draft_probs.float()).clamp_min(0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, target_probs, residual)


def greedy_verify(draft_token_ids: torch.Tensor, target_logits: torch.Tensor) -> RejectionOutput:
    """Greedy verification: accept while ``draft_j == argmax(target_logits_j)``.

    Args:
        draft_token_ids: ``[B, k]`` int64.
        target_logits: ``[B, k + 1, V]``; row ``j`` scores the token after draft ``j``'s prefix.
    """
    tokens, num_accepted = greedy_accept(draft_token_ids, target_logits.argmax(dim=-1))  # one launch on a GPU
    return RejectionOutput(tokens, num_accepted)


def random_verify(draft_token_ids: torch.Tensor, target_logits: torch.Tensor, meta: SamplingMetadata,
                  accept_uniforms: torch.Tensor, sample_uniforms: torch.Tensor,
                  draft_probs: Optional[torch.Tensor] = None,
                  sampled: Optional[SampledDrafts] = None) -> RejectionOutput:
    """Speculative rejection sampling (see the module docstring for the sources).

    Args:
        draft_token_ids: ``[B, k]`` int64, drawn from ``draft_probs`` (or greedy when ``None``).
        target_logits: ``[B, k + 1, V]``.
        meta: ``B`` rows of sampling parameters (temperature > 0 expected; see
            :func:`~mtpspec.sample.sampler.compute_probs`).
        accept_uniforms: ``[B, k]`` in ``[0, 1)``: the accept tests (only with ``draft_probs``).
        sample_uniforms: ``[B, k + 1]`` in ``[0, 1)``: one per decided position (slot ``k``:
            the bonus draw).
        draft_probs: ``[B, k, V]`` draft distributions, or ``None`` for one-hot (greedy) drafts.
        sampled: rows with vocab-sharded sampled drafts (:class:`SampledDrafts`; only with
            ``draft_probs=None``): their accept test is ``u * q(x) < p(x)`` with
            ``accept_uniforms``, their recovered token a vocab-parallel Gumbel draw from the
            residual, their bonus token the same draw from ``p_k`` as the others'.

    With ``draft_probs=None`` slot ``j`` draws ``x_j = sample_inverse_cdf(p_j, sample_uniforms[:, j])``
    (what :class:`~mtpspec.sample.sampler.Sampler` draws from the same row), accepts the draft
    iff it equals ``x_j`` and otherwise emits ``x_j`` (drawn from the residual with the uniform
    rescaled around the draft's interval): the same distribution as the accept test, and the
    emitted tokens equal plain sampling's with the same uniforms, whatever the drafts were.
    """
    b, k1, vocab = target_logits.shape
    k = k1 - 1
    probs = compute_probs(target_logits.reshape(b * k1, vocab), meta.repeat_interleave(k1)).view(b, k1, vocab)
    p_draft = probs[:, :k].gather(-1, draft_token_ids.unsqueeze(-1)).squeeze(-1)
    draws = sample_uniforms.double()
    if draft_probs is None:
        # One-hot drafts, coupled with plain sampling: x_j = the token plain sampling draws with
        # this position's uniform; accept iff x_j == draft (probability p(draft), as in
        # Leviathan et al.); on rejection the uniform is mapped onto the residual so that the
        # recovered token is x_j. Emitted tokens then do not depend on the drafts (k, preemption).
        x = sample_inverse_cdf(probs[:, :k].reshape(b * k, vocab), draws[:, :k].reshape(b * k)).view(b, k)
        accepted = x == draft_token_ids
        pk = probs[:, :k]
        total = pk.sum(dim=-1, dtype=torch.float64)
        t = draws[:, :k] * total
        p_d = p_draft.double()
        ids = torch.arange(vocab, device=pk.device)
        below = torch.where(ids < draft_token_ids.unsqueeze(-1), pk, 0.0).sum(dim=-1, dtype=torch.float64)
        t = torch.where(t < below, t, t - p_d)
        u_res = (t / (total - p_d).clamp_min(1e-300)).clamp(0.0, 1.0 - 2 ** -53)
        draws = torch.cat([u_res, draws[:, k:]], dim=1)
    else:
        q_draft = draft_probs.float().gather(-1, draft_token_ids.unsqueeze(-1)).squeeze(-1)
        accepted = accept_uniforms.double() * q_draft.double() < p_draft.double()
    num_accepted = _leading_true_count(accepted)
    weights = torch.cat([_residual_weights(probs[:, :k], draft_token_ids, draft_probs), probs[:, k:]], dim=1)
    final = sample_inverse_cdf(weights.reshape(b * k1, vocab), draws.reshape(b * k1)).view(b, k1)
    if sampled is not None:
        if draft_probs is not None:
            raise ValueError("pass either draft_probs or sampled drafts, not both")
        q_draft = sampled.log_q.double().exp()
        acc_s = _leading_true_count(accept_uniforms.double() * q_draft < p_draft.double())
        final_s = torch.cat([_residual_tokens(probs[:, :k], sampled), final[:, k:]], dim=1)
        m = sampled.mask.unsqueeze(1)
        num_accepted = torch.where(sampled.mask, acc_s, num_accepted)
        final = torch.where(m, final_s, final)
        # Drafts whose q is gone: accept none, emit plain sampling's token at slot 0 (x_0).
        num_accepted = torch.where(sampled.ignore, torch.zeros_like(num_accepted), num_accepted)
        final[:, 0] = torch.where(sampled.ignore, x[:, 0], final[:, 0])
    return RejectionOutput(assemble_output_tokens(draft_token_ids, final, num_accepted), num_accepted)


class RejectionSampler(torch.nn.Module):
    """Verifies ``k`` draft tokens per sequence against the target's ``k + 1`` logits rows."""

    def forward(self, draft_token_ids: torch.Tensor, target_logits: torch.Tensor, meta: SamplingMetadata,
                accept_uniforms: Optional[torch.Tensor] = None, sample_uniforms: Optional[torch.Tensor] = None,
                draft_probs: Optional[torch.Tensor] = None,
                sampled: Optional[SampledDrafts] = None) -> RejectionOutput:
        """Greedy rows via :func:`greedy_verify`, random rows via :func:`random_verify`.

        Shapes as in :func:`random_verify`. The uniforms may be ``None`` only when every row is
        greedy. Raises ``ValueError`` on inconsistent shapes.
        """
        if draft_token_ids.dim() != 2 or target_logits.dim() != 3:
            raise ValueError(f"need draft_token_ids [B, k] and target_logits [B, k + 1, V], got "
                             f"{tuple(draft_token_ids.shape)} and {tuple(target_logits.shape)}")
        b, k = draft_token_ids.shape
        if target_logits.shape[:2] != (b, k + 1):
            raise ValueError(f"target_logits must be [B={b}, k + 1={k + 1}, V], got {tuple(target_logits.shape)}")
        if meta.all_greedy:
            return greedy_verify(draft_token_ids, target_logits)
        if accept_uniforms is None or sample_uniforms is None:
            raise ValueError("random rows need accept_uniforms [B, k] and sample_uniforms [B, k + 1]")
        if accept_uniforms.shape != (b, k) or sample_uniforms.shape != (b, k + 1):
            raise ValueError(f"uniforms must be [B, k]={[b, k]} and [B, k + 1]={[b, k + 1]}, got "
                             f"{list(accept_uniforms.shape)} and {list(sample_uniforms.shape)}")
        extra = {} if sampled is None else {"sampled": sampled}
        rand = random_verify(draft_token_ids, target_logits, meta, accept_uniforms, sample_uniforms, draft_probs,
                             **extra)
        if meta.all_random:
            return rand
        greedy = greedy_verify(draft_token_ids, target_logits)
        g = meta.is_greedy
        return RejectionOutput(torch.where(g.unsqueeze(1), greedy.output_token_ids, rand.output_token_ids),
                               torch.where(g, greedy.num_accepted, rand.num_accepted))

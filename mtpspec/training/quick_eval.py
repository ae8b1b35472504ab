"""Quick checks of a model while it trains: held-out losses and a greedy speculative-decoding
simulation (full recompute, no KV cache) to estimate MTP acceptance.

The simulation follows the engine's draft convention (vLLM's MTP proposer): with ``n`` accepted
tokens and the target's next token ``x``, draft step 1 runs the MTP layer over rows ``0..n-1``
(row ``r``: target post-norm hidden ``h_r``, embedding of token ``r + 1`` — ``x`` for the last
row — at position ``r``); step ``j > 1`` appends row ``n - 2 + j`` (the previous step's draft
token, the previous step's MTP output at the last row as ``previous_hidden_states``, position
``n - 2 + j``) and uses layer ``(j - 1) % D``. The target then verifies greedily; the step
emits ``x`` plus the accepted prefix of the drafts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Sequence

import torch
from torch import nn

from mtpspec.training.packing import Batch
from mtpspec.training.step import forward_loss

if TYPE_CHECKING:
    from mtpspec.training.dsa import DsaTraining


@torch.no_grad()
def validation_metrics(target: nn.Module, mtp: nn.Module, batches: Sequence[Batch], device: torch.device,
                       mtp_lambda: float, mtp_depth: int = 1, dsa: Optional["DsaTraining"] = None) -> Dict[str, object]:
    """Token-weighted held-out ``target_loss``, ``mtp_loss`` (depth 1), ``mtp_losses`` (every
    training depth), top-1 accuracies, and ``draft_agreement``: the fraction of rows where the
    depth-1 MTP argmax at ``i`` equals the target's argmax at ``i + 1`` (teacher forced; a proxy
    for the k = 1 acceptance rate).

    DSA models (``dsa`` given; the attention runs in its current mode): ``indexer_kl``, the mean
    over batches of the indexers' ``L^I`` (per-call means averaged), and ``index_recall``, the share
    of the dense attention mass (mean over heads) that the indexers' top-k holds on rows whose
    context is longer than ``index_topk`` (``None`` without such rows)."""
    sums = {"target_loss": 0.0, "mtp_loss": 0.0, "target_acc": 0.0, "mtp_acc": 0.0, "draft_agreement": 0.0}
    depth_sums, depth_counts = [0.0] * mtp_depth, [0] * mtp_depth
    n_t = n_m = 0
    kl_sum, kl_n, recall_mass, recall_rows = 0.0, 0, 0.0, 0
    for batch in batches:
        out, hidden, (ids, pos, doc_end) = forward_loss(target, mtp, batch, device, mtp_lambda, return_hidden=True,
                                                        mtp_depth=mtp_depth, dsa=dsa, measure_dsa=dsa is not None)
        if "indexer_kl" in out.dsa_stats:
            kl_sum += out.dsa_stats["indexer_kl"]
            kl_n += 1
        if out.dsa_stats.get("index_recall") is not None:
            recall_mass += out.dsa_stats["index_recall"] * out.dsa_stats["index_recall_rows"]
            recall_rows += out.dsa_stats["index_recall_rows"]
        for j, (lj, cj) in enumerate(zip(out.mtp_losses, out.counts[1:])):
            depth_sums[j] += lj.item() * cj
            depth_counts[j] += cj
        sums["target_loss"] += out.target_loss.item() * out.counts[0]
        n_t += out.counts[0]
        t_arg = target.compute_logits(hidden).argmax(-1)
        n = ids.numel()
        idx = torch.arange(n, device=device)
        counted = batch.loss_from(device)  # rows before a document's loss_start do not count
        counted = torch.ones_like(idx, dtype=torch.bool) if counted is None else idx >= counted
        v0 = idx + 1 < doc_end
        sums["target_acc"] += (t_arg[:-1] == ids[1:])[(v0 & counted)[:-1]].float().sum().item()
        if mtp_depth >= 1:
            sums["mtp_loss"] += out.mtp_losses[0].item() * out.counts[1]
            n_m += out.counts[1]
            ids1 = torch.where(v0, torch.roll(ids, -1), torch.zeros_like(ids))  # every real token: the context
            with_meta = _with_rows_meta(batch, device)
            with with_meta:
                m_arg = mtp.compute_logits(mtp(ids1, pos, hidden, spec_step_idx=0), 0).argmax(-1)
            v1 = (idx + 2 < doc_end) & counted
            sums["mtp_acc"] += (m_arg[:-2] == ids[2:])[v1[:-2]].float().sum().item()
            sums["draft_agreement"] += (m_arg[:-1] == t_arg[1:])[v1[:-1]].float().sum().item()
    out_d = {"target_loss": sums["target_loss"] / max(n_t, 1), "target_acc": sums["target_acc"] / max(n_t, 1)}
    if n_m:
        out_d.update(mtp_loss=sums["mtp_loss"] / n_m, mtp_acc=sums["mtp_acc"] / n_m,
                     draft_agreement=sums["draft_agreement"] / n_m,
                     mtp_losses=[x / max(c, 1) for x, c in zip(depth_sums, depth_counts)])
    if dsa is not None:
        out_d.update(indexer_kl=kl_sum / kl_n if kl_n else None,
                     index_recall=recall_mass / recall_rows if recall_rows else None, dsa_mode=dsa.mode)
    return out_d


def _with_rows_meta(batch: Batch, device: torch.device):
    from mtpspec.layers.attention import build_attention_metadata, set_forward_context
    b, length = batch.input_ids.shape
    return set_forward_context(build_attention_metadata([length] * b, [length] * b, None, device=device))


def _target_step(target: nn.Module, seq: List[int], device: torch.device):
    ids = torch.tensor(seq, device=device)
    hidden = target(ids, torch.arange(len(seq), device=device))
    return hidden, target.compute_logits(hidden).argmax(-1)


@torch.no_grad()
def simulate_greedy_spec_decode(target: nn.Module, mtp: nn.Module, prompt: Sequence[int], k: int, max_new: int,
                                eot_id: int, device: torch.device) -> Dict[str, object]:
    """Greedy speculative decoding of one prompt with ``k`` MTP drafts per step (module docstring).

    Returns:
        ``{"tokens": generated ids, "steps": target verification steps, "accepted": accepted drafts
        per step, "per_position": accepted counts per draft position [k]}``; acceptance length is
        ``len(tokens) / steps`` (1 + mean accepted), up to the final step's truncation.
    """
    seq = list(prompt)
    gen: List[int] = []
    accepted: List[int] = []
    per_pos = [0] * k
    hidden, greedy = _target_step(target, seq, device)
    while len(gen) < max_new:
        x = int(greedy[-1])
        n = len(seq)
        if x == eot_id or len(gen) + 1 >= max_new:
            gen.append(x)
            accepted.append(0)
            break
        # draft
        ids = seq[1:] + [x]
        rows_ids, rows_pos, prev = list(ids), list(range(n)), hidden
        drafts: List[int] = []
        for j in range(1, k + 1):
            out = mtp(torch.tensor(rows_ids, device=device), torch.tensor(rows_pos, device=device), prev,
                      spec_step_idx=j - 1)
            d = int(mtp.compute_logits(out[-1:], j - 1).argmax(-1))
            drafts.append(d)
            rows_ids.append(d)
            rows_pos.append(n - 1 + j)
            prev = torch.cat([prev, out[-1:]], 0)
        # verify
        hidden_v, greedy_v = _target_step(target, seq + [x] + drafts, device)
        a = 0
        while a < k and int(greedy_v[n + a]) == drafts[a]:
            per_pos[a] += 1
            a += 1
            if drafts[a - 1] == eot_id:
                break
        new = [x] + drafts[:a]
        gen += new
        accepted.append(a)
        seq += new
        if eot_id in new:
            gen = gen[:gen.index(eot_id) + 1]
            break
        keep = len(seq)
        hidden, greedy = hidden_v[:keep], greedy_v[:keep]
    return {"tokens": gen[:max_new], "steps": len(accepted), "accepted": accepted, "per_position": per_pos}


def acceptance_summary(target: nn.Module, mtp: nn.Module, prompts: Sequence[Sequence[int]], k: int,
                       max_new: int, eot_id: int, device: torch.device,
                       deadline: float = float("inf")) -> Dict[str, object]:
    """Mean acceptance length (tokens per target step) and per-position acceptance rates over
    ``prompts`` (stops early, counting only finished prompts, once ``time.time() > deadline``)."""
    import time
    was = (target.training, mtp.training)
    target.eval()
    mtp.eval()
    tokens = steps = done = 0
    per_pos = [0] * k
    try:
        for p in prompts:
            if time.time() > deadline:
                break
            done += 1
            r = simulate_greedy_spec_decode(target, mtp, p, k, max_new, eot_id, device)
            tokens += len(r["tokens"])
            steps += r["steps"]
            per_pos = [a + b for a, b in zip(per_pos, r["per_position"])]
    finally:
        target.train(was[0])
        mtp.train(was[1])
    return {"k": k, "acceptance_length": tokens / max(steps, 1), "prompts": done, "steps": steps, "tokens": tokens,
            "per_position_rate": [c / max(steps, 1) for c in per_pos]}

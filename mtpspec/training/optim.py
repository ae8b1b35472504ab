"""AdamW with fp32 master weights for low-precision models, the LR schedule, and the MoE router's
auxiliary-loss-free load balancing."""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Tuple

import torch
from torch import nn


class MasterWeightAdamW:
    """AdamW (Loshchilov & Hutter 2019) on fp32 master copies of the model's parameters.

    bf16 / fp16 parameters get an fp32 master; after each step the master is rounded back into
    the model parameter (mixed-precision training, Micikevicius et al. 2018, section 3.1). fp32
    parameters are updated directly. Weight decay applies to matrices (``dim >= 2``) only.

    Args:
        params: the unique trainable parameters.
        lr, betas, weight_decay, eps: AdamW hyper-parameters.
    """

    def __init__(self, params: Iterable[nn.Parameter], lr: float, betas: Tuple[float, float],
                 weight_decay: float, eps: float = 1e-8) -> None:
        self.pairs: List[Tuple[nn.Parameter, torch.Tensor]] = []
        decay, no_decay = [], []
        for p in params:
            m = p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
            self.pairs.append((p, m))
            (decay if p.dim() >= 2 else no_decay).append(m)
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        fused = all(m.is_cuda for _, m in self.pairs) and bool(self.pairs)
        self.opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)

    @property
    def masters(self) -> List[torch.Tensor]:
        return [m for _, m in self.pairs]

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def step(self, grad_clip: float) -> float:
        """Move grads to the masters, clip their global norm to ``grad_clip`` (0: no clipping),
        step, and copy back. Returns the pre-clip gradient norm."""
        for p, m in self.pairs:
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
        masters = [m for m in self.masters if m.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(masters, grad_clip if grad_clip > 0 else float("inf"))
        self.opt.step()
        with torch.no_grad():
            for p, m in self.pairs:
                if m is not p:
                    p.copy_(m)
        return float(norm)

    def zero_grad(self) -> None:
        for p, m in self.pairs:
            p.grad = None
            m.grad = None


def lr_at(step: int, progress: float, base_lr: float, warmup_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up over ``warmup_steps`` steps, then cosine decay to ``min_lr_ratio * base_lr``
    as ``progress`` (fraction of the run done, by steps or by time) goes from 0 to 1."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    p = min(max(progress, 0.0), 1.0)
    return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


class RouterBalancer:
    """Auxiliary-loss-free load balancing (DeepSeek-V3 report, section 2.1.2): after each step,
    ``e_score_correction_bias += speed * sign(mean_load - load)`` per MoE gate, where ``load``
    counts the tokens routed to each expert during the step. The bias only affects which experts
    are chosen, never the gate weights, so it takes no gradient."""

    def __init__(self, modules: Iterable[nn.Module], speed: float) -> None:
        from mtpspec.layers.fused_moe import MoEGate
        self.speed = speed
        self.gates = [m for mod in modules for m in mod.modules() if isinstance(m, MoEGate)
                      and m.e_score_correction_bias is not None]
        self.counts: Dict[int, torch.Tensor] = {}
        for g in {id(g): g for g in self.gates}.values():
            g.e_score_correction_bias.requires_grad_(False)
            g.register_forward_hook(self._hook)

    def _hook(self, gate: nn.Module, inputs, output) -> None:
        if not torch.is_grad_enabled():
            return
        ids = output[1].reshape(-1)
        c = torch.bincount(ids, minlength=gate.e_score_correction_bias.numel()).float()
        self.counts[id(gate)] = self.counts.get(id(gate), 0) + c

    def restrict_to(self, modules: Iterable[nn.Module]) -> None:
        """From now on update only the gates inside ``modules`` (the others keep their bias)."""
        keep = {id(m) for mod in modules for m in mod.modules()}
        self.gates = [g for g in self.gates if id(g) in keep]

    @torch.no_grad()
    def step(self) -> float:
        """Apply the update; returns the largest ``max_load / mean_load`` among the gates (1 = even)."""
        worst = 1.0
        for g in self.gates:
            c = self.counts.get(id(g))
            if c is None or c.sum() == 0:
                continue
            mean = c.mean()
            if self.speed > 0:
                g.e_score_correction_bias.add_(self.speed * torch.sign(mean - c))
            worst = max(worst, float(c.max() / mean))
        self.counts.clear()
        return worst

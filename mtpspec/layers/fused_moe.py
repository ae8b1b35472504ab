"""Mixture-of-experts: the sigmoid grouped top-k router and tensor-parallel SwiGLU experts.

Router (DeepSeek-V3 technical report, arXiv:2412.19437, section 2.1.2, eqs. 15-16, and its
auxiliary-loss-free bias, section 2.1.2 "Auxiliary-Loss-Free Load Balancing"; the same router
GLM-4.5 uses, as Hugging Face's ``Glm4MoeTopkRouter`` computes it):

* ``s = sigmoid(x W_g^T)`` in fp32 (``W_g`` kept in fp32 like Hugging Face does);
* choice scores ``c = s + e_score_correction_bias`` (the bias only affects which experts win);
* experts form ``n_group`` equal groups; a group's score is the sum of its two best ``c``; only
  the ``topk_group`` best groups stay eligible;
* the ``top_k`` best eligible ``c`` pick the experts; their weights are the plain ``s``,
  divided by their sum (+1e-20) when ``norm_topk_prob``, times ``routed_scaling_factor``.

Experts (:class:`FusedMoE`) are split across tensor-parallel ranks by intermediate size
(Megatron-style, like a dense MLP): every rank holds every expert's slice
``[r * I / tp, (r + 1) * I / tp)`` of the gate/up rows and the matching down columns, so each
rank returns a partial sum over its slices that the caller all-reduces (or leaves un-reduced,
``reduce_results=False``, for a later fused all-reduce + norm).

How the experts run (:func:`moe_path`, chosen from static sizes so a captured CUDA graph always
replays one path): Triton expert-grouped GEMMs wherever Triton runs (every batch size, no host
sync, only routed experts' weights read); without Triton, a gather path for tiny batches, an
all-experts dense path for small ones, and a per-expert grouped loop (one host sync) above. FP8
block-scaled experts (built inside :func:`~mtpspec.layers.fp8.fp8_weights`) always take path
``"fp8"``: :func:`~mtpspec.ops.fp8_gemm.fp8_moe_experts`, expert-grouped FP8 GEMMs (sync-free)
where Triton runs, else a loop over the routed experts calling the dense FP8 op (one host sync).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from mtpspec.distributed import (
    get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce)
from mtpspec.layers.activation import SiluAndMul
from mtpspec.layers.fp8 import check_column_cut, copy_scale_rows, current_fp8_block, fp8_param, scale_param
from mtpspec.layers.weight_utils import check_full_tensor, copy_into
from mtpspec.ops.fp8_gemm import fp8_moe_experts
from mtpspec.ops.moe_gemm import moe_experts, moe_experts_ref
from mtpspec.ops.moe_router import fused_route, grouped_topk_triton, router_logits
from mtpspec.ops.triton_utils import FLOAT_DTYPES, cdiv, use_triton

#: Paths of :meth:`FusedMoE.forward` without a host sync (CUDA-graph capturable).
GRAPH_SAFE_PATHS = ("kernel", "gather", "dense")


def kernel_chunk_tokens(top_k: int, hidden: int, inter_per_rank: int, elem_bytes: int, budget_bytes: int) -> int:
    """Tokens per launch of the expert kernels so their scratch (``top_k`` pairs per token, each
    ``H`` fp32 + ``I / tp`` weight-dtype values) stays within ``budget_bytes`` (at least 1)."""
    return max(1, budget_bytes // max(1, top_k * (hidden * 4 + inter_per_rank * elem_bytes)))


def moe_path(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter_per_rank: int, elem_bytes: int,
             triton: bool, kernel_budget_bytes: int, gather_budget_bytes: int, dense_budget_bytes: int) -> str:
    """Which expert path a batch takes, from static sizes only.

    * ``"kernel"`` whenever the Triton kernels run (``triton``: CUDA, or CPU under
      ``TRITON_INTERPRET=1``, and fp16/bf16/fp32): expert-grouped GEMMs reading only routed
      experts (:mod:`mtpspec.ops.moe_gemm`), in chunks of :func:`kernel_chunk_tokens` tokens.
    * ``"gather"`` (torch) when ``3 * num_tokens * top_k <= num_experts`` (gathering, copying
      and reading the routed experts' weights costs less than reading all experts once) and the
      gathered weights fit ``gather_budget_bytes``.
    * ``"dense"`` (torch) when every expert on every token fits ``dense_budget_bytes``
      (``num_tokens * E * max(H, 2 I / tp) * 4``).
    * ``"grouped"`` otherwise (torch, per-expert loop, one host sync).
    """
    n = num_tokens * top_k
    if triton and num_tokens:
        return "kernel"
    if num_tokens and 3 * n <= num_experts and n * 3 * inter_per_rank * hidden * elem_bytes <= gather_budget_bytes:
        return "gather"
    if num_tokens and num_tokens * num_experts * max(hidden, 2 * inter_per_rank) * 4 <= dense_budget_bytes:
        return "dense"
    return "grouped"


def check_routing_sizes(num_experts: int, top_k: int, num_expert_group: int, topk_group: int) -> None:
    """Raises ValueError unless the groups divide the experts, ``topk_group <= num_expert_group``
    and ``top_k <= num_experts`` (the message names all four)."""
    e = num_experts
    if e % num_expert_group or topk_group > num_expert_group or top_k > e:
        raise ValueError(f"grouped_topk: num_experts={e}, num_expert_group={num_expert_group}, "
                         f"topk_group={topk_group}, top_k={top_k} are inconsistent")


def grouped_topk(router_logits: torch.Tensor, e_score_correction_bias: Optional[torch.Tensor], top_k: int,
                 num_expert_group: int = 1, topk_group: int = 1, renormalize: bool = True,
                 routed_scaling_factor: float = 1.0, num_shared_experts: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid grouped top-k routing (see the module docstring).

    Args:
        router_logits: ``[num_tokens, num_experts]`` (computed in fp32).
        e_score_correction_bias: ``[num_experts]`` or ``None`` (no bias).
        top_k: experts per token.
        num_expert_group, topk_group: groups, and how many stay eligible (1, 1 = no grouping).
        renormalize: divide the chosen weights by their sum (``norm_topk_prob``).
        routed_scaling_factor: multiplies the final weights.
        num_shared_experts: ``S`` shared experts fused into the routed ones
            (:meth:`FusedMoE.absorb_shared_experts`): ``S`` more columns, ids ``E .. E + S - 1``,
            weight 1.0 (not scaled), after the ``top_k`` routed ones.

    Returns:
        ``(topk_weights [num_tokens, top_k + S] float32, topk_ids [num_tokens, top_k + S] int64)``;
        routed ids in no particular order (Triton: best first, :mod:`mtpspec.ops.moe_router`, which runs
        wherever Triton does; the torch ops otherwise).

    Raises:
        ValueError: inconsistent sizes.
    """
    t, e = router_logits.shape
    check_routing_sizes(e, top_k, num_expert_group, topk_group)
    if use_triton(router_logits, e_score_correction_bias):  # one launch (decode sizes: ~10-17 fewer)
        return grouped_topk_triton(router_logits, e_score_correction_bias, top_k, num_expert_group, topk_group,
                                   renormalize, routed_scaling_factor, num_shared_experts=num_shared_experts)
    scores = router_logits.float().sigmoid()
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if num_expert_group > 1:
        per = e // num_expert_group
        group_scores = choice.view(t, num_expert_group, per).topk(min(2, per), dim=-1)[0].sum(dim=-1)
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        score_mask = group_mask.unsqueeze(-1).expand(t, num_expert_group, per).reshape(t, e)
        choice = choice.masked_fill(score_mask == 0, float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    topk_weights = topk_weights * routed_scaling_factor
    if num_shared_experts:
        shared = torch.arange(e, e + num_shared_experts, device=topk_ids.device).expand(t, num_shared_experts)
        topk_ids = torch.cat([topk_ids, shared], 1)
        topk_weights = torch.cat([topk_weights, topk_weights.new_ones(t, num_shared_experts)], 1)
    return topk_weights, topk_ids


class MoEGate(nn.Module):
    """The router: fp32 ``weight [num_experts, hidden]`` and ``e_score_correction_bias [num_experts]``.

    ``forward(x [T, H]) -> (topk_weights [T, top_k + S] fp32, topk_ids [T, top_k + S] int64)``;
    the logits are computed in fp32 whatever ``x``'s dtype. Both parameters are replicated and
    always fp32 (checkpoint tensors are converted on load). ``S = num_shared_fused`` (0 unless the
    MoE fused its shared experts into the routed ones: then ids ``E ..`` with weight 1.0 follow).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, num_expert_group: int = 1,
                 topk_group: int = 1, renormalize: bool = True, routed_scaling_factor: float = 1.0,
                 use_correction_bias: bool = True) -> None:
        super().__init__()
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.num_expert_group, self.topk_group = num_expert_group, topk_group
        self.renormalize, self.routed_scaling_factor = renormalize, float(routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = _replicated_loader
        if use_correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                        requires_grad=False)
            self.e_score_correction_bias.weight_loader = _replicated_loader
        else:
            self.register_parameter("e_score_correction_bias", None)
        self.num_shared_fused = 0

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        check_routing_sizes(self.weight.shape[0], self.top_k, self.num_expert_group, self.topk_group)
        fused = fused_route(x, self.weight, self.e_score_correction_bias, self.top_k, self.num_expert_group,
                            self.topk_group, self.renormalize, self.routed_scaling_factor, self.num_shared_fused)
        if fused is not None:  # decode sizes on Triton: logits and routing in one launch
            return fused
        logits = router_logits(x, self.weight)  # F.linear(x.float(), weight); one launch at decode sizes
        return grouped_topk(logits, self.e_score_correction_bias, self.top_k, self.num_expert_group,
                            self.topk_group, self.renormalize, self.routed_scaling_factor, self.num_shared_fused)


def _replicated_loader(param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: object = None) -> None:
    if loaded_shard_id is not None:
        raise ValueError(f"replicated parameter takes no shard id, got {loaded_shard_id!r}")
    check_full_tensor("router parameter", loaded_weight, param.shape)
    copy_into(param.data, loaded_weight)


class FusedMoE(nn.Module):
    """Routed SwiGLU experts, split across TP ranks by intermediate size.

    Args:
        num_experts: routed experts ``E``.
        hidden_size: ``H``.
        intermediate_size: per-expert intermediate size ``I`` (divisible by tp).
        reduce_results: all-reduce the output; ``False`` returns this rank's partial sum.
        params_dtype: parameter dtype (default ``torch.get_default_dtype()``).
        dense_budget_bytes: torch path: batches whose per-expert intermediates fit this budget
            (``num_tokens * E * max(H, 2 I / tp) * 4`` bytes) run every expert on every token in
            batched matmuls weighted by the (mostly zero) routing weights (no host sync).
        gather_budget_bytes: torch path: very small batches (``3 * num_tokens * top_k <= E``)
            gather their routed experts' weights (``w[topk_ids]``, at most this many bytes) and
            run batched matmuls (no host sync, reads only routed experts).
        kernel_budget_bytes: Triton path (CUDA): scratch per launch; larger batches run in
            token chunks. Used for every batch size where Triton runs (no host sync).

        Paths and their choice: :func:`moe_path`. Only the torch ``"grouped"`` fallback (large
        batches without Triton) syncs with the host, for the per-expert counts.

    Attributes:
        w13_weight: ``[E (+ S), 2 * I / tp, H]``, per expert ``[gate_r | up_r]``.
        w2_weight: ``[E (+ S), H, I / tp]``, per expert the down projection's columns of this rank.
        num_total_experts: ``E + S`` (property: the weights' expert count).
        num_shared_fused: ``S``, shared experts appended as experts ``E .. E + S - 1`` by
            :meth:`absorb_shared_experts` (0 until then; property, from the weights).
        fp8_block: ``(block_n, block_k)`` when built inside :func:`~mtpspec.layers.fp8.fp8_weights`
            (then both weights are ``float8_e4m3fn`` with float32 ``w13_weight_scale_inv [E,
            ceil(2 I / tp / w13_scale_block_n), ceil(H / block_k)]`` and ``w2_weight_scale_inv
            [E, ceil(H / block_n), ceil(I / tp / block_k)]``; ``w13_scale_block_n`` is block_n
            when ``I / tp`` is a multiple of it, else 1 (a scale row per weight row); the
            forward is :func:`~mtpspec.ops.fp8_gemm.fp8_moe_experts`, path ``"fp8"``), else None.

    ``weight_loader(param, full_tensor, shard_id, expert_id)``:
        ``shard_id`` ``"w1"`` (gate ``[I, H]``), ``"w3"`` (up ``[I, H]``), ``"w2"`` (down ``[H, I]``)
        for one expert; with ``expert_id=None`` the tensor holds every expert: ``"w13"``
        ``[E, 2 I, H]`` (gate rows then up rows, Hugging Face's fused ``gate_up_proj``) or
        ``"w2"`` ``[E, H, I]``.

    Raises:
        ValueError: ``intermediate_size % tp != 0``; bad shard/expert ids or shapes on load.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, reduce_results: bool = True,
                 params_dtype: Optional[torch.dtype] = None, dense_budget_bytes: int = 128 * 2 ** 20,
                 gather_budget_bytes: int = 256 * 2 ** 20, kernel_budget_bytes: int = 256 * 2 ** 20) -> None:
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        if intermediate_size % self.tp_size:
            raise ValueError(f"FusedMoE: intermediate_size={intermediate_size} is not divisible by the "
                             f"tensor-parallel size {self.tp_size}")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.intermediate_size_per_partition = ip = intermediate_size // self.tp_size
        self.reduce_results = reduce_results
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.fp8_block = current_fp8_block()
        self._new_weights()
        self.act_fn = SiluAndMul()
        self.dense_budget_bytes = dense_budget_bytes
        self.gather_budget_bytes = gather_budget_bytes
        self.kernel_budget_bytes = kernel_budget_bytes

    @property
    def num_total_experts(self) -> int:
        return self.w13_weight.shape[0]

    @property
    def num_shared_fused(self) -> int:
        return self.num_total_experts - self.num_experts

    @torch.no_grad()
    def absorb_shared_experts(self, gate_up: torch.Tensor, down: torch.Tensor, num_shared: int) -> None:
        """Append a loaded shared-expert MLP as ``num_shared`` more experts (SGLang's shared-experts
        fusion): the routers then route every token to them with weight 1.0, and one pair of expert
        GEMMs serves both (decode sizes: 5 launches fewer per MoE layer: the shared MLP's two GEMMs,
        SiLU, multiply and the add). Exact in real arithmetic: a SwiGLU MLP of intermediate ``S x I``
        is the sum of ``S`` SwiGLU MLPs over its intermediate columns cut in ``S`` parts.

        Args:
            gate_up: this rank's ``MergedColumnParallelLinear`` weight ``[2 * S * I / tp, H]`` (gate
                rows, then up rows).
            down: this rank's ``RowParallelLinear`` weight ``[H, S * I / tp]``.
            num_shared: ``S`` (``n_shared_experts``).

        Raises:
            ValueError: shapes that do not fit; called twice; FP8 experts (not supported).
        """
        e, h, ip, s = self.num_experts, self.hidden_size, self.intermediate_size_per_partition, num_shared
        if self.fp8_block is not None or self.num_shared_fused:
            raise ValueError("FusedMoE.absorb_shared_experts: FP8 experts, or shared experts already absorbed")
        if s < 1 or gate_up.shape != (2 * s * ip, h) or down.shape != (h, s * ip):
            raise ValueError(f"FusedMoE.absorb_shared_experts: gate_up {list(gate_up.shape)} / down "
                             f"{list(down.shape)} do not fit {s} shared experts of [{2 * ip}, {h}] / [{h}, {ip}]")
        w13 = torch.empty(e + s, 2 * ip, h, dtype=self.w13_weight.dtype, device=self.w13_weight.device)
        w13[:e] = self.w13_weight
        w13[e:, :ip] = gate_up[:s * ip].view(s, ip, h)
        w13[e:, ip:] = gate_up[s * ip:].view(s, ip, h)
        w2 = torch.empty(e + s, h, ip, dtype=self.w2_weight.dtype, device=self.w2_weight.device)
        w2[:e] = self.w2_weight
        w2[e:] = down.view(h, s, ip).transpose(0, 1)
        self.w13_weight = nn.Parameter(w13, requires_grad=False)
        self.w2_weight = nn.Parameter(w2, requires_grad=False)

    def _new_weights(self) -> None:
        e, h, ip = self.num_experts, self.hidden_size, self.intermediate_size_per_partition
        if self.fp8_block is None:
            self.w13_weight = nn.Parameter(torch.empty(e, 2 * ip, h, dtype=self.params_dtype), requires_grad=False)
            self.w2_weight = nn.Parameter(torch.empty(e, h, ip, dtype=self.params_dtype), requires_grad=False)
            self.w13_scale_block_n = None
            params = (self.w13_weight, self.w2_weight)
        else:
            bn, bk = self.fp8_block
            self.w13_scale_block_n = bn if ip % bn == 0 else 1
            self.w13_weight, self.w2_weight = fp8_param(e, 2 * ip, h), fp8_param(e, h, ip)
            self.w13_weight_scale_inv = scale_param(e, cdiv(2 * ip, self.w13_scale_block_n), cdiv(h, bk))
            self.w2_weight_scale_inv = scale_param(e, cdiv(h, bn), cdiv(ip, bk))
            params = (self.w13_weight, self.w2_weight, self.w13_weight_scale_inv, self.w2_weight_scale_inv)
        for p in params:
            p.weight_loader = self.weight_loader

    def unquantize(self) -> None:
        """Turn FP8 experts into plain ones (fresh ``params_dtype`` weights), for a checkpoint that
        stores them unquantised."""
        if self.fp8_block is None:
            return
        device = self.w13_weight.device
        del self.w13_weight_scale_inv, self.w2_weight_scale_inv
        self.fp8_block = None
        with torch.device(device):
            self._new_weights()

    @torch.no_grad()
    def _load_scale(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str, expert_id: Optional[int]) -> None:
        """This rank's part of a full block-scale tensor (the weight's shard, sliced on blocks)."""
        e, h, i, ip, r = self.num_experts, self.hidden_size, self.intermediate_size, \
            self.intermediate_size_per_partition, self.tp_rank
        bn, bk = self.fp8_block
        sbn = self.w13_scale_block_n
        loaded = loaded.float()
        experts = range(e) if expert_id is None else [expert_id]
        if expert_id is not None and not 0 <= expert_id < e:
            raise ValueError(f"FusedMoE: expert_id {expert_id} out of range [0, {e})")
        if param is self.w13_weight_scale_inv and shard_id in ("w13", "w1", "w3"):
            if shard_id == "w13":
                if expert_id is not None or i % bn:
                    raise ValueError(f"FusedMoE: fused gate_up_proj FP8 scales need intermediate_size {i} to be a "
                                     f"multiple of the block {bn} (gate and up would share block rows)")
                check_full_tensor("FusedMoE gate_up_proj_scale_inv", loaded, (e, cdiv(2 * i, bn), cdiv(h, bk)))
                parts = ((loaded[:, :i // bn], 0), (loaded[:, i // bn:], ip))
            else:
                check_full_tensor(f"FusedMoE expert {expert_id} {shard_id} weight_scale_inv", loaded,
                                  (cdiv(i, bn), cdiv(h, bk)))
                parts = ((loaded.unsqueeze(0), 0 if shard_id == "w1" else ip),)
            for full, dst0 in parts:
                for j, x in enumerate(experts):
                    copy_scale_rows(param.data[x], dst0, full[j], r * ip, ip, bn, sbn)
        elif param is self.w2_weight_scale_inv and shard_id == "w2":
            check_column_cut("FusedMoE down_proj", ip, i, self.tp_size, bk)
            shape = (cdiv(h, bn), cdiv(i, bk)) if expert_id is not None else (e, cdiv(h, bn), cdiv(i, bk))
            check_full_tensor("FusedMoE down_proj weight_scale_inv", loaded, shape)
            cols = loaded.narrow(-1, r * ip // bk, cdiv(ip, bk))
            copy_into(param.data[expert_id] if expert_id is not None else param.data, cols)
        else:
            raise ValueError(f"FusedMoE: shard_id {shard_id!r} does not fit this scale parameter")

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str,
                      expert_id: Optional[int] = None) -> None:
        """Copy this rank's slice of a full checkpoint tensor (see the class docstring)."""
        e, h, i, ip, r = self.num_experts, self.hidden_size, self.intermediate_size, \
            self.intermediate_size_per_partition, self.tp_rank
        if self.fp8_block is not None:
            if param is self.w13_weight_scale_inv or param is self.w2_weight_scale_inv:
                self._load_scale(param, loaded_weight, shard_id, expert_id)
                return
            if param is self.w2_weight:
                check_column_cut("FusedMoE down_proj", ip, i, self.tp_size, self.fp8_block[1])
        if expert_id is None:
            if shard_id == "w13" and param is self.w13_weight:
                check_full_tensor("FusedMoE gate_up_proj", loaded_weight, (e, 2 * i, h))
                copy_into(param.data[:, :ip], loaded_weight[:, r * ip:(r + 1) * ip])
                copy_into(param.data[:, ip:], loaded_weight[:, i + r * ip:i + (r + 1) * ip])
            elif shard_id == "w2" and param is self.w2_weight:
                check_full_tensor("FusedMoE down_proj", loaded_weight, (e, h, i))
                copy_into(param.data, loaded_weight[:, :, r * ip:(r + 1) * ip])
            else:
                raise ValueError(f"FusedMoE: shard_id {shard_id!r} does not fit this parameter for all experts")
            return
        if not 0 <= expert_id < e:
            raise ValueError(f"FusedMoE: expert_id {expert_id} out of range [0, {e})")
        if shard_id in ("w1", "w3") and param is self.w13_weight:
            check_full_tensor(f"FusedMoE expert {expert_id} {shard_id}", loaded_weight, (i, h))
            dst = slice(0, ip) if shard_id == "w1" else slice(ip, 2 * ip)
            copy_into(param.data[expert_id, dst], loaded_weight[r * ip:(r + 1) * ip])
        elif shard_id == "w2" and param is self.w2_weight:
            check_full_tensor(f"FusedMoE expert {expert_id} w2", loaded_weight, (h, i))
            copy_into(param.data[expert_id], loaded_weight[:, r * ip:(r + 1) * ip])
        else:
            raise ValueError(f"FusedMoE: shard_id {shard_id!r} does not fit this parameter")

    def select_path(self, num_tokens: int, top_k: int, x: torch.Tensor) -> str:
        """The path :meth:`forward` takes for ``num_tokens`` rows like ``x`` (see :func:`moe_path`)."""
        if self.fp8_block is not None:
            return "fp8"
        return moe_path(num_tokens, top_k, self.num_total_experts, self.hidden_size,
                        self.intermediate_size_per_partition, self.w13_weight.element_size(),
                        use_triton(x, self.w13_weight) and x.dtype in FLOAT_DTYPES and x.dtype == self.w13_weight.dtype,
                        self.kernel_budget_bytes, self.gather_budget_bytes, self.dense_budget_bytes)

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x_t)`` over this rank's slices.

        Args:
            hidden_states: ``[num_tokens, H]`` in the parameter dtype.
            topk_weights: ``[num_tokens, top_k]`` (fp32).
            topk_ids: ``[num_tokens, top_k]`` int64 in ``[0, E + S)`` (``S = num_shared_fused``).

        Returns:
            ``[num_tokens, H]`` in ``hidden_states``' dtype: the full sum when
            ``reduce_results``, else this rank's partial sum.

        The path (:meth:`select_path`) depends only on shapes, dtypes and where the tensors
        live, so one captured CUDA graph always replays the path it captured; every path but
        ``"grouped"`` is free of host syncs.
        """
        t, k = topk_ids.shape
        path = self.select_path(t, k, hidden_states)
        if path == "fp8":
            out = self._forward_fp8(hidden_states, topk_weights, topk_ids)
        elif path == "kernel":
            out = self._forward_kernel(hidden_states, topk_weights, topk_ids)
        elif path == "gather":
            out = moe_experts_ref(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        elif path == "dense":
            out = self._forward_dense(hidden_states, topk_weights, topk_ids)
        else:
            out = self._forward_grouped(hidden_states, topk_weights, topk_ids)
        return tensor_model_parallel_all_reduce(out) if self.reduce_results else out

    def _forward_fp8(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        t, k = topk_ids.shape
        # scratch per pair: gate | up (2 I / tp) and act (I / tp) in x's dtype, H fp32
        chunk = kernel_chunk_tokens(k, self.hidden_size, 3 * self.intermediate_size_per_partition, x.element_size(),
                                    self.kernel_budget_bytes)
        args = (self.w13_weight, self.w13_weight_scale_inv, self.w2_weight, self.w2_weight_scale_inv)
        blocks = (self.w13_scale_block_n, self.fp8_block[0], self.fp8_block[1])
        if t <= chunk:
            return fp8_moe_experts(x, *args, topk_weights, topk_ids, *blocks)
        return torch.cat([fp8_moe_experts(x[s:s + chunk], *args, topk_weights[s:s + chunk], topk_ids[s:s + chunk],
                                          *blocks) for s in range(0, t, chunk)])

    def _forward_kernel(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        t, k = topk_ids.shape
        chunk = kernel_chunk_tokens(k, self.hidden_size, self.intermediate_size_per_partition,
                                    self.w13_weight.element_size(), self.kernel_budget_bytes)
        if t <= chunk:
            return moe_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return torch.cat([moe_experts(x[s:s + chunk], self.w13_weight, self.w2_weight, topk_weights[s:s + chunk],
                                      topk_ids[s:s + chunk]) for s in range(0, t, chunk)])

    def _forward_dense(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # Every expert on every token, unrouted (expert, token) products zeroed: sync-free.
        t, e = x.shape[0], self.num_total_experts
        combine = torch.zeros(t, e, dtype=torch.float32, device=x.device)
        combine.scatter_add_(1, topk_ids, topk_weights.float())  # [T, E], zero for unrouted experts
        gate_up = torch.matmul(x.unsqueeze(0), self.w13_weight.transpose(1, 2))  # [E, T, 2 I/tp]
        y = torch.bmm(self.act_fn(gate_up), self.w2_weight.transpose(1, 2))  # [E, T, H]
        y = y.masked_fill(combine.t().unsqueeze(-1) == 0, 0)  # unrouted: exactly 0 (no inf * 0)
        return torch.einsum("te,eth->th", combine, y.float()).to(x.dtype)

    def _forward_grouped(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        if x.shape[0]:
            flat_ids = topk_ids.reshape(-1)
            order = torch.argsort(flat_ids, stable=True)
            counts = torch.bincount(flat_ids, minlength=self.num_total_experts).tolist()  # host sync
            token_of = order // topk_ids.shape[1]
            start = 0
            for eid, n in enumerate(counts):
                if n == 0:
                    continue
                sel = order[start:start + n]
                tok = token_of[start:start + n]
                start += n
                xe = x.index_select(0, tok)
                y = F.linear(self.act_fn(F.linear(xe, self.w13_weight[eid])), self.w2_weight[eid])
                w = topk_weights.reshape(-1).index_select(0, sel).unsqueeze(-1)
                out.index_add_(0, tok, (y * w).to(out.dtype))
        return out

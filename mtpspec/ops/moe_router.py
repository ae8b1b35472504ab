"""The sigmoid grouped top-k router in Triton: one launch for routing (:func:`grouped_topk_triton`,
a program per token row on a GPU) instead of about 10, or 17 with expert groups, and up to
:data:`LOGITS_KERNEL_MAX_TOKENS` tokens one launch for the router logits and the routing together
(:func:`fused_route`: the logits GEMV's last program to finish routes every row in one tile).

Math: :func:`mtpspec.layers.fused_moe.grouped_topk` (DeepSeek-V3 technical report, arXiv:2412.19437,
sec. 2.1.2, eqs. 15-16, with the auxiliary-loss-free bias). Per token row of ``router_logits``:
``s = sigmoid(logits)``, ``c = s + bias``; with groups, a group's score is the sum of its two best
``c`` (its best alone when a group has one expert) and only the ``topk_group`` best groups stay
eligible; the ``top_k`` best eligible ``c`` are chosen (ties: the lowest expert id, for groups and
experts alike; a NaN ``c`` ranks above every number, as in ``torch.topk``): one after another, or,
where a program's ``rows x E x E`` comparisons fit (:data:`RANK_MAX_ELEMS`), every expert ranked at
once (the same choice); weights are their ``s``, divided by their sum + 1e-20 when
``renormalize``, times ``routed_scaling_factor``. Rows are routed independently (no row reads
another), but a token's fp32 logits and weights can differ in the last bit with the batch size
(the GEMV's ``BLOCK_H`` and the routing tile's rows follow the token count), so two experts within
that margin can swap between verification and plain decoding, as with any GEMM whose reduction
order follows the shape.

Ids come out in the order chosen (best first); the torch reference's order is unspecified
(``topk(sorted=False)``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from mtpspec.ops.triton_utils import HAS_TRITON, LazyKernel, cdiv, tl, triton, use_triton

#: The routing picks its experts by ranking them all at once where a program's ``ROWS x E x E``
#: comparisons stay within this many (1 token at E <= 128), one after another otherwise.
RANK_MAX_ELEMS = 16384

if HAS_TRITON:
    _RANK_MAX_ELEMS = tl.constexpr(RANK_MAX_ELEMS)  # as the kernels can read it
    from mtpspec.ops.triton_helpers import last_to_arrive, pdl_begin
    from mtpspec.ops.triton_utils import device_function

    @device_function
    def _route_rows(logits_ptr, bias_ptr, w_ptr, ids_ptr, rows, num_tokens, num_experts, per_group, stride_l,
                    scale, HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr, N_GROUP: tl.constexpr,
                    G_P2: tl.constexpr, TOPK_GROUP: tl.constexpr, TWO_PER_GROUP: tl.constexpr,
                    RENORM: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr, N_SHARED: tl.constexpr,
                    CACHE: tl.constexpr):
        # token rows `rows` ([ROWS] int64), each routed on its own ([ROWS, BLOCK_E] tiles); CACHE: the
        # logits' load cache modifier ("" or ".cg": written by other programs of the same launch)
        rok = rows < num_tokens
        ex = tl.arange(0, BLOCK_E)
        ok = ex < num_experts
        x = tl.load(logits_ptr + rows[:, None] * stride_l + ex[None, :], mask=rok[:, None] & ok[None, :],
                    other=0.0, cache_modifier=CACHE).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-x))
        c = s
        if HAS_BIAS:
            c = c + tl.load(bias_ptr + ex, mask=ok, other=0.0).to(tl.float32)[None, :]
        c = tl.where(c != c, float("inf"), c)  # NaN ranks first, as torch.topk ranks it
        c = tl.where(ok[None, :], c, float("-inf"))
        if N_GROUP > 1:  # keep the TOPK_GROUP best groups (score: sum of the group's two best c)
            gr = tl.arange(0, G_P2)
            real = gr < N_GROUP
            member = (ex[None, :] // per_group == gr[:, None]) & ok[None, :]  # [G_P2, BLOCK_E]
            cg = tl.where(member[None, :, :], c[:, None, :], float("-inf"))  # [ROWS, G_P2, BLOCK_E]
            best = tl.max(cg, 2)
            first = tl.min(tl.where(cg == best[:, :, None], ex[None, None, :], BLOCK_E), 2)
            score = best
            if TWO_PER_GROUP:
                score = best + tl.max(tl.where(ex[None, None, :] == first[:, :, None], float("-inf"), cg), 2)
            kept = tl.zeros([ROWS, G_P2], dtype=tl.int1)
            for _ in tl.static_range(TOPK_GROUP):
                avail = tl.where(kept | ~real[None, :], float("-inf"), score)
                m = tl.max(avail, 1)
                g = tl.min(tl.where((avail == m[:, None]) & ~kept & real[None, :], gr[None, :], G_P2), 1)
                kept = kept | (gr[None, :] == g[:, None])
            eligible = tl.sum((member[None, :, :] & kept[:, :, None]).to(tl.int32), 1) > 0  # [ROWS, BLOCK_E]
            c = tl.where(eligible, c, float("-inf"))
        kk = tl.arange(0, K_P2)
        if ROWS * BLOCK_E * BLOCK_E <= _RANK_MAX_ELEMS:
            # every expert's rank at once (how many valid experts beat it; ties: the lower id), a few
            # reductions instead of 2 TOP_K dependent ones; the slot of a chosen expert is its rank
            beats = ((c[:, None, :] > c[:, :, None]) | ((c[:, None, :] == c[:, :, None])
                                                         & (ex[None, None, :] < ex[None, :, None])))
            rank = tl.sum((beats & ok[None, None, :]).to(tl.int32), 2)  # [ROWS, BLOCK_E]
            at = (rank[:, None, :] == kk[None, :, None]) & ok[None, None, :] & (kk < TOP_K)[None, :, None]
            w = tl.sum(tl.where(at, s[:, None, :], 0.0), 2)
            ids = tl.sum(tl.where(at, ex[None, None, :], 0), 2).to(tl.int64)
        else:
            w = tl.zeros([ROWS, K_P2], dtype=tl.float32)
            ids = tl.zeros([ROWS, K_P2], dtype=tl.int64)
            taken = tl.zeros([ROWS, BLOCK_E], dtype=tl.int1)
            for j in tl.static_range(TOP_K):
                avail = tl.where(taken | ~ok[None, :], float("-inf"), c)
                m = tl.max(avail, 1)
                pick = tl.min(tl.where((avail == m[:, None]) & ~taken & ok[None, :], ex[None, :], BLOCK_E), 1)
                hit = ex[None, :] == pick[:, None]
                taken = taken | hit
                w = tl.where(kk[None, :] == j, tl.sum(tl.where(hit, s, 0.0), 1)[:, None], w)
                ids = tl.where(kk[None, :] == j, pick.to(tl.int64)[:, None], ids)
        if RENORM:
            w = w / (tl.sum(w, 1)[:, None] + 1e-20)
        out = rows[:, None] * (TOP_K + N_SHARED) + kk[None, :]
        keep = rok[:, None] & (kk[None, :] < TOP_K)
        tl.store(w_ptr + out, w * scale, mask=keep)
        tl.store(ids_ptr + out, ids, mask=keep)
        for j in tl.static_range(N_SHARED):  # fused shared experts: ids E + j, weight 1 (unscaled)
            tl.store(w_ptr + rows * (TOP_K + N_SHARED) + TOP_K + j, tl.full([ROWS], 1.0, tl.float32), mask=rok)
            tl.store(ids_ptr + rows * (TOP_K + N_SHARED) + TOP_K + j,
                     tl.full([ROWS], 0, tl.int64) + num_experts + j, mask=rok)

    def _router_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, num_tokens, num_experts, per_group, stride_l, scale,
                       HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr, N_GROUP: tl.constexpr,
                       G_P2: tl.constexpr, TOPK_GROUP: tl.constexpr, TWO_PER_GROUP: tl.constexpr,
                       RENORM: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr, N_SHARED: tl.constexpr,
                       PDL: tl.constexpr):
        pdl_begin(PDL)
        # ROWS token rows per program
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        _route_rows(logits_ptr, bias_ptr, w_ptr, ids_ptr, rows, num_tokens, num_experts, per_group, stride_l, scale,
                    HAS_BIAS, TOP_K, K_P2, N_GROUP, G_P2, TOPK_GROUP, TWO_PER_GROUP, RENORM, ROWS, BLOCK_E, N_SHARED,
                    "")

    _router = LazyKernel(_router_kernel, pdl=True)

    def _logits_route_kernel(x_ptr, gw_ptr, logits_ptr, cnt_ptr, bias_ptr, w_ptr, ids_ptr, num_tokens, hidden,
                             num_experts, stride_x, per_group, scale,
                             BLOCK_T: tl.constexpr, BLOCK_E_DOT: tl.constexpr, BLOCK_H: tl.constexpr,
                             HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr, N_GROUP: tl.constexpr,
                             G_P2: tl.constexpr, TOPK_GROUP: tl.constexpr, TWO_PER_GROUP: tl.constexpr,
                             RENORM: tl.constexpr, BLOCK_E: tl.constexpr, N_SHARED: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        # _logits_kernel's GEMV (BLOCK_E_DOT experts a program); the last program to finish routes
        # every token (BLOCK_T rows in one tile) from the logits the others wrote
        _logits_block(x_ptr, gw_ptr, logits_ptr, num_tokens, hidden, num_experts, stride_x,
                      BLOCK_T, BLOCK_E_DOT, BLOCK_H)
        if last_to_arrive(cnt_ptr, tl.num_programs(0)):
            _route_rows(logits_ptr, bias_ptr, w_ptr, ids_ptr, tl.arange(0, BLOCK_T).to(tl.int64), num_tokens,
                        num_experts, per_group, num_experts, scale, HAS_BIAS, TOP_K, K_P2, N_GROUP, G_P2, TOPK_GROUP,
                        TWO_PER_GROUP, RENORM, BLOCK_T, BLOCK_E, N_SHARED, ".cg")
            tl.store(cnt_ptr, 0)

    _logits_route = LazyKernel(_logits_route_kernel, pdl=True)

    def _logits_kernel(x_ptr, w_ptr, out_ptr, num_tokens, hidden, num_experts, stride_x,
                       BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        _logits_block(x_ptr, w_ptr, out_ptr, num_tokens, hidden, num_experts, stride_x, BLOCK_T, BLOCK_E, BLOCK_H)

    @device_function
    def _logits_block(x_ptr, w_ptr, out_ptr, num_tokens, hidden, num_experts, stride_x,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
        # out[t, e] = sum_h float(x[t, h]) * w[e, h] in fp32, BLOCK_E experts per program, every token
        ex = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
        tk = tl.arange(0, BLOCK_T)
        eok, tok = ex < num_experts, tk < num_tokens
        # products summed lane-wise over the H loop, reduced across lanes once at the end
        acc = tl.zeros([BLOCK_T, BLOCK_E, BLOCK_H], dtype=tl.float32)
        for h0 in range(0, hidden, BLOCK_H):
            hh = h0 + tl.arange(0, BLOCK_H)
            hok = hh < hidden
            xv = tl.load(x_ptr + tk[:, None] * stride_x + hh[None, :], mask=tok[:, None] & hok[None, :],
                         other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + ex[:, None].to(tl.int64) * hidden + hh[None, :], mask=eok[:, None] & hok[None, :],
                         other=0.0)
            acc += xv[:, None, :] * wv[None, :, :]
        tl.store(out_ptr + tk[:, None] * num_experts + ex[None, :], tl.sum(acc, 2), mask=tok[:, None] & eok[None, :])

    _logits = LazyKernel(_logits_kernel, pdl=True)

#: :func:`router_logits` runs its Triton GEMV up to this many tokens (cuBLAS above).
LOGITS_KERNEL_MAX_TOKENS = 16


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x.float(), weight)``: the fp32 router logits ``[T, E]`` of ``x [T, H]`` (any float
    dtype) and ``weight [E, H]`` fp32. Up to :data:`LOGITS_KERNEL_MAX_TOKENS` tokens on Triton it
    is one launch (a GEMV, ``BLOCK_E`` experts per program, fp32 products and sums) where torch
    pays three (the cast, cuBLAS's dot and its reduction); the sums' order differs from cuBLAS's
    (fp32 rounding)."""
    t, h = x.shape
    if not (use_triton(x, weight) and 0 < t <= LOGITS_KERNEL_MAX_TOKENS and x.stride(1) == 1
            and weight.dtype == torch.float32 and weight.is_contiguous()):
        return F.linear(x.float(), weight)
    e = weight.shape[0]
    out = torch.empty(t, e, dtype=torch.float32, device=x.device)
    bt = triton.next_power_of_2(t)
    _logits[(cdiv(e, 2),)](x, weight, out, t, h, e, x.stride(0), BLOCK_T=bt, BLOCK_E=2,
                           BLOCK_H=_gemv_block_h(bt), num_warps=4)
    return out


def _gemv_block_h(block_t: int) -> int:
    """Hidden columns per step of the logits GEMV for ``block_t`` token rows (its accumulator:
    2,048 fp32 up to 8 tokens)."""
    return max(128, 1024 // block_t)


def fused_route(x: torch.Tensor, weight: torch.Tensor, e_score_correction_bias: Optional[torch.Tensor], top_k: int,
                num_expert_group: int = 1, topk_group: int = 1, renormalize: bool = True,
                routed_scaling_factor: float = 1.0, num_shared_experts: int = 0
                ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`router_logits` then :func:`grouped_topk_triton` in ONE launch, for decode-size
    batches: the logits GEMV's programs write the fp32 logits ``[T, E]`` and the last of them to
    finish (:func:`~mtpspec.ops.triton_helpers.last_to_arrive`) routes every token from them. Same
    arguments and outputs as the two calls: the same experts in the same order, the weights to fp32
    rounding (one expert per GEMV program here, two there, and all tokens in one routing tile: the
    compiled sums may associate differently).
    ``x [T, H]`` (any float dtype, unit stride in H), ``weight [E, H]`` fp32; returns ``(topk_weights
    [T, top_k + S] float32, topk_ids [T, top_k + S] int64)`` with ``S = num_shared_experts``, or None
    where it does not apply (the caller then makes the two calls): no Triton for these tensors, not
    ``0 < T <= LOGITS_KERNEL_MAX_TOKENS``, a non-unit-stride ``x`` row or a router weight that is not
    contiguous fp32. Raises nothing itself: the caller checks the sizes (as for
    :func:`grouped_topk_triton`). Scratch: the logits, ``[T, E]`` fp32; one arrival counter."""
    t, h = x.shape
    bias = e_score_correction_bias
    if not (use_triton(x, weight, bias) and 0 < t <= LOGITS_KERNEL_MAX_TOKENS and x.stride(1) == 1
            and weight.dtype == torch.float32 and weight.is_contiguous()):
        return None
    from mtpspec.ops.triton_utils import arrival_counters
    e = weight.shape[0]
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    w = torch.empty(t, top_k + num_shared_experts, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k + num_shared_experts, dtype=torch.int64, device=x.device)
    bt = triton.next_power_of_2(t)
    _logits_route[(e,)](  # one expert a program (the GEMV: more programs, a shorter loop each)
        x, weight, logits, arrival_counters(x.device, 1), bias if bias is not None else weight, w, ids, t, h, e,
        x.stride(0), e // num_expert_group, float(routed_scaling_factor), BLOCK_T=bt, BLOCK_E_DOT=1,
        BLOCK_H=_gemv_block_h(bt), num_warps=4,
        **_routing_constexprs(e, top_k, num_expert_group, topk_group, renormalize, num_shared_experts, bias))
    return w, ids


def grouped_topk_triton(router_logits: torch.Tensor, e_score_correction_bias: Optional[torch.Tensor], top_k: int,
                        num_expert_group: int = 1, topk_group: int = 1, renormalize: bool = True,
                        routed_scaling_factor: float = 1.0, rows: Optional[int] = None, num_shared_experts: int = 0
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`~mtpspec.layers.fused_moe.grouped_topk` as one Triton launch (module docstring).

    Args and returns as there (``router_logits [T, E]`` any float dtype, read in fp32; returns
    ``(topk_weights [T, top_k] float32, topk_ids [T, top_k] int64)``); the caller checks sizes.
    ``rows``: token rows per program (a power of two; default 1 on a GPU, up to 128 under the
    interpreter, which pays per program). ``num_shared_experts`` ``S``: shared experts fused into the
    routed ones (``FusedMoE.absorb_shared_experts``): the outputs get ``S`` more columns, ids
    ``E .. E + S - 1`` with weight 1.0 (not scaled), ``[T, top_k + S]``.
    """
    t, e = router_logits.shape
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    w = torch.empty(t, top_k + num_shared_experts, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k + num_shared_experts, dtype=torch.int64, device=logits.device)
    if t == 0:
        return w, ids
    bias = e_score_correction_bias
    rows = rows or (1 if logits.is_cuda else min(triton.next_power_of_2(t), 128))
    _router[(cdiv(t, rows),)](
        logits, bias if bias is not None else logits, w, ids, t, e, e // num_expert_group, logits.stride(0),
        float(routed_scaling_factor), ROWS=rows, num_warps=4 if e <= 512 else 8,
        **_routing_constexprs(e, top_k, num_expert_group, topk_group, renormalize, num_shared_experts, bias))
    return w, ids


def _routing_constexprs(e: int, top_k: int, num_expert_group: int, topk_group: int, renormalize: bool,
                        num_shared_experts: int, bias: Optional[torch.Tensor]) -> dict:
    """The routing's compile-time parameters (``_route_rows``), shared by both launches."""
    return dict(HAS_BIAS=bias is not None, TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), N_GROUP=num_expert_group,
                G_P2=triton.next_power_of_2(num_expert_group), TOPK_GROUP=topk_group,
                TWO_PER_GROUP=e // num_expert_group >= 2, RENORM=renormalize, BLOCK_E=triton.next_power_of_2(e),
                N_SHARED=num_shared_experts)


__all__ = ["LOGITS_KERNEL_MAX_TOKENS", "fused_route", "grouped_topk_triton", "router_logits"]

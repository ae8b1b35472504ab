"""Tensor-parallel linear layers (Megatron-LM's column/row split; vLLM's class names).

Shoeybi et al. 2019, "Megatron-LM", section 3: a column-parallel layer splits the weight's
output rows across ranks (no communication in forward); a row-parallel layer splits its input
columns and sums the partial products with an all-reduce. ``weight`` is ``[out, in]`` as in
``torch.nn.functional.linear``.

Every parameter carries ``weight_loader(param, loaded_weight, loaded_shard_id=None)``, which takes
the FULL unsharded checkpoint tensor, checks its shape (``ValueError`` naming expected and actual
shapes) and dtype (``TypeError`` unless floating point), and copies this rank's slice converted to
the parameter's dtype. Parameters are uninitialised (``torch.empty``) until loaded.
``forward`` returns a tensor (not vLLM's ``(output, bias)`` tuple).

FP8 block-scaled weights (:mod:`mtpspec.layers.fp8`): a layer built with ``quantize=True``
inside :func:`~mtpspec.layers.fp8.fp8_weights` holds ``weight`` as ``torch.float8_e4m3fn`` and
``weight_scale_inv`` (float32 block scales, sliced with the weight by the same
``weight_loader``) and multiplies through :func:`mtpspec.ops.fp8_gemm.fp8_block_linear`; its
``params_dtype`` stays the activation (compute) dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mtpspec.distributed import (
    get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce)
from mtpspec.layers.fp8 import (
    check_column_cut, copy_scale_rows, current_fp8_block, fp8_param, rows_aligned, scale_param)
from mtpspec.layers.weight_utils import check_full_tensor, copy_into, default_weight_loader
from mtpspec.ops import skinny_gemm
from mtpspec.ops.fp8_gemm import fp8_block_linear
from mtpspec.ops.triton_utils import cdiv


def _positive_int(cls: str, name: str, v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{cls}: {name} must be an int >= 1, got {v!r}")
    return v


def _divide(cls: str, name: str, size: int, tp: int) -> int:
    if size % tp:
        raise ValueError(f"{cls}: {name}={size} is not divisible by the tensor-parallel size {tp}")
    return size // tp


class LinearBase(nn.Module):
    """Common state: sizes, TP rank/size, parameter dtype, input checks.

    Attributes:
        input_size, output_size: the full (unsharded) sizes.
        tp_rank, tp_size: this process's place in the TP group at construction.
        params_dtype: dtype of every parameter (of the activations, when the weight is FP8).
        fp8_block: ``(block_n, block_k)`` when the weight is FP8 block-scaled, else None;
        scale_block_n: weight rows per ``weight_scale_inv`` row (``block_n``, or 1 where shards
            do not cut on block rows: :mod:`mtpspec.layers.fp8`).

    ``quantize``: whether the layer takes FP8 weights inside an
    :func:`~mtpspec.layers.fp8.fp8_weights` context (False: always ``params_dtype``; e.g.
    ``kv_b_proj``, used in absorbed form, and the indexer's fp32 ``weights_proj``).
    """

    def __init__(self, input_size: int, output_size: int, params_dtype: Optional[torch.dtype] = None,
                 quantize: bool = True):
        super().__init__()
        name = type(self).__name__
        self.input_size = _positive_int(name, "input_size", input_size)
        self.output_size = _positive_int(name, "output_size", output_size)
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.fp8_block = current_fp8_block() if quantize else None
        self.scale_block_n: Optional[int] = None

    def _new_weight(self, rows: int, cols: int, scale_block_n: Optional[int] = None) -> None:
        """``self.weight`` ``[rows, cols]``: ``params_dtype``, or FP8 plus ``weight_scale_inv``
        ``[ceil(rows / scale_block_n), ceil(cols / block_k)]`` (default ``scale_block_n``: block_n)."""
        if self.fp8_block is None:
            self.weight = self._new_param(rows, cols)
            return
        bn, bk = self.fp8_block
        self.scale_block_n = bn if scale_block_n is None else scale_block_n
        self.weight = fp8_param(rows, cols)
        self.weight.weight_loader = self.weight_loader
        self.weight_scale_inv = scale_param(cdiv(rows, self.scale_block_n), cdiv(cols, bk))
        self.weight_scale_inv.weight_loader = self.weight_loader

    def unquantize(self) -> None:
        """Turn an FP8 layer into a plain one (fresh ``params_dtype`` weight, no scales), for a
        checkpoint that stores this layer unquantised (``modules_to_not_convert``)."""
        if self.fp8_block is None:
            return
        rows, cols = self.weight.shape
        device = self.weight.device
        del self.weight_scale_inv
        self.fp8_block, self.scale_block_n = None, None
        with torch.device(device):
            self.weight = self._new_param(rows, cols)

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.fp8_block is None:
            return skinny_gemm.linear(x, self.weight, bias)  # F.linear unless the few-row kernel is on
        return fp8_block_linear(x, self.weight, self.weight_scale_inv, self.scale_block_n, self.fp8_block[1], bias)

    def _new_param(self, *shape: int) -> nn.Parameter:
        p = nn.Parameter(torch.empty(*shape, dtype=self.params_dtype), requires_grad=False)
        p.weight_loader = self.weight_loader
        return p

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: Optional[Any] = None) -> None:
        default_weight_loader(param, loaded_weight, loaded_shard_id)

    def _check_input(self, x: torch.Tensor, size: int) -> None:
        if x.dim() < 1 or x.shape[-1] != size:
            raise ValueError(f"{type(self).__name__}: expected input [..., {size}], got {list(x.shape)}")
        if x.dtype != self.params_dtype:
            raise TypeError(f"{type(self).__name__}: input dtype {x.dtype} != weight dtype {self.params_dtype}")


class ReplicatedLinear(LinearBase):
    """``y = x W^T + b`` with the full weight on every rank (no communication).

    Args:
        input_size, output_size: ``W`` is ``[output_size, input_size]``.
        bias: add a ``[output_size]`` bias.
        params_dtype: parameter dtype (default ``torch.get_default_dtype()``).

    ``forward(x)``: ``[..., input_size] -> [..., output_size]`` in ``params_dtype``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, quantize: bool = True):
        super().__init__(input_size, output_size, params_dtype, quantize)
        self._new_weight(output_size, input_size)
        self.bias = self._new_param(output_size) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x, self.input_size)
        return self._linear(x, self.bias)


@dataclass(frozen=True)
class OutputShard:
    """One logical output block of a column-parallel weight, as this rank sees it.

    Rows ``[src_start, src_start + size)`` of the block's full ``[full_size, ...]`` checkpoint
    tensor go to rows ``[dst_start, dst_start + size)`` of this rank's parameter.
    """

    full_size: int
    src_start: int
    size: int
    dst_start: int


class ColumnParallelLinear(LinearBase):
    """``y = x W^T + b`` with ``W``'s output rows split evenly across ranks.

    Rank ``r`` holds rows ``[r * output_size / tp, (r + 1) * output_size / tp)`` of ``W`` (and of ``b``).

    Args:
        input_size, output_size: full sizes; ``output_size`` must be divisible by tp.
        bias: add a bias (sharded like the rows).
        gather_output: all-gather the output so every rank returns ``[..., output_size]``;
            otherwise each returns its ``[..., output_size / tp]`` slice.
        params_dtype: parameter dtype (default ``torch.get_default_dtype()``).

    Raises:
        ValueError: non-positive sizes or ``output_size % tp != 0``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False,
                 params_dtype: Optional[torch.dtype] = None, quantize: bool = True):
        super().__init__(input_size, output_size, params_dtype, quantize)
        per = _divide(type(self).__name__, "output_size", output_size, self.tp_size)
        self._init_column({None: OutputShard(output_size, self.tp_rank * per, per, 0)}, per, bias, gather_output)

    def _init_column(self, shards: Dict[Any, OutputShard], per_partition: int, bias: bool,
                     gather_output: bool) -> None:
        self.output_shards = shards
        self.output_size_per_partition = per_partition
        self.gather_output = gather_output
        sbn = None
        if self.fp8_block is not None:
            bn = self.fp8_block[0]
            cuts = [(s.full_size, s.src_start, s.size, s.dst_start) for s in shards.values()]
            sbn = bn if rows_aligned(cuts, bn, per_partition) else 1
        self._new_weight(per_partition, self.input_size, sbn)
        self.bias = self._new_param(per_partition) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: Optional[Any] = None) -> None:
        """Copy this rank's rows of a full checkpoint tensor into ``param`` (weight or bias).

        Args:
            loaded_shard_id: ``None`` loads the whole fused tensor ``[output_size, ...]``;
                subclasses with logical blocks (merged gate/up, q/k/v) also take a block id,
                with the block's full tensor ``[block_size, ...]``.

        Raises:
            ValueError: unknown shard id or wrong full shape. TypeError: non-floating tensor.
        """
        name = type(self).__name__
        if self.fp8_block is not None and param is self.weight_scale_inv:
            self._load_scale(loaded_weight, loaded_shard_id)
            return
        tail = tuple(param.shape[1:])
        if loaded_shard_id is None and None not in self.output_shards:
            full = sum(s.full_size for s in self.output_shards.values())
            check_full_tensor(f"{name} fused weight", loaded_weight, (full,) + tail)
            start = 0
            for sid, sh in self.output_shards.items():
                self.weight_loader(param, loaded_weight.narrow(0, start, sh.full_size), sid)
                start += sh.full_size
            return
        sh = self._output_shard(loaded_shard_id)
        what = f"{name} shard {loaded_shard_id!r}" if loaded_shard_id is not None else f"{name} weight"
        check_full_tensor(what, loaded_weight, (sh.full_size,) + tail)
        copy_into(param.data.narrow(0, sh.dst_start, sh.size), loaded_weight.narrow(0, sh.src_start, sh.size))

    def _output_shard(self, shard_id: Optional[Any]) -> "OutputShard":
        """The output shard of ``shard_id``; ValueError naming the known ids for another."""
        if shard_id not in self.output_shards:
            raise ValueError(f"{type(self).__name__}: unknown loaded_shard_id {shard_id!r}; "
                             f"expected one of {list(self.output_shards)}")
        return self.output_shards[shard_id]

    def _load_scale(self, loaded: torch.Tensor, shard_id: Optional[Any]) -> None:
        """This rank's rows of the full block scales (``[ceil(full / block_n), ceil(input / block_k)]``
        of one logical block, or of the fused tensor when ``shard_id`` is None)."""
        name = type(self).__name__
        bn, bk = self.fp8_block
        kb = cdiv(self.input_size, bk)
        if shard_id is None and None not in self.output_shards:
            sizes = [s.full_size for s in self.output_shards.values()]
            if any(sz % bn for sz in sizes[:-1]):
                raise ValueError(f"{name}: a fused FP8 weight of blocks {sizes} has block rows of {bn} straddling "
                                 "two blocks; store the blocks as separate tensors")
            check_full_tensor(f"{name} fused weight_scale_inv", loaded, (cdiv(sum(sizes), bn), kb))
            start = 0
            for sid, sh in self.output_shards.items():
                self._load_scale(loaded.narrow(0, start // bn, cdiv(sh.full_size, bn)), sid)
                start += sh.full_size
            return
        sh = self._output_shard(shard_id)
        check_full_tensor(f"{name} weight_scale_inv" + ("" if shard_id is None else f" shard {shard_id!r}"),
                          loaded, (cdiv(sh.full_size, bn), kb))
        copy_scale_rows(self.weight_scale_inv.data, sh.dst_start, loaded.float(), sh.src_start, sh.size, bn,
                        self.scale_block_n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., input_size] -> [..., output_size / tp]`` (``[..., output_size]`` if gather_output).

        Raises:
            ValueError: wrong last dimension. TypeError: ``x.dtype`` differs from the weight's.
        """
        self._check_input(x, self.input_size)
        y = self._linear(x, self.bias)
        return tensor_model_parallel_all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one weight (e.g. gate and up projections).

    Each block ``i`` of size ``output_sizes[i]`` is split across ranks separately: rank ``r``'s
    weight is ``concat_i(block_i rows [r * s_i / tp, (r + 1) * s_i / tp))``, so the local output
    is ``[gate_r | up_r]``. ``weight_loader(param, block_tensor, i)`` loads block ``i`` from its
    full ``[output_sizes[i], input_size]`` tensor; ``loaded_shard_id=None`` takes the fused
    ``[sum(output_sizes), input_size]`` tensor.

    Raises:
        ValueError: empty ``output_sizes``, a non-positive size, or a size not divisible by tp.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, quantize: bool = True):
        name = type(self).__name__
        output_sizes = list(output_sizes)
        if not output_sizes:
            raise ValueError(f"{name}: output_sizes must not be empty")
        for s in output_sizes:
            _positive_int(name, "output_sizes[i]", s)
        LinearBase.__init__(self, input_size, sum(output_sizes), params_dtype, quantize)
        self.output_sizes: List[int] = output_sizes
        shards: Dict[Any, OutputShard] = {}
        dst = 0
        for i, s in enumerate(output_sizes):
            per = _divide(name, f"output_sizes[{i}]", s, self.tp_size)
            shards[i] = OutputShard(s, self.tp_rank * per, per, dst)
            dst += per
        self._init_column(shards, dst, bias, gather_output=False)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection with grouped-query attention (Ainslie et al. 2023, "GQA").

    Query heads are split evenly across ranks. Key/value heads are split when
    ``total_num_kv_heads >= tp``; when ``tp > total_num_kv_heads`` they are replicated: each rank
    holds one kv head, rank ``r`` uses kv head ``r // (tp // total_num_kv_heads)``.
    The local output is ``[q (q_size) | k (kv_size) | v (kv_size)]``.

    Args:
        hidden_size: input size.
        head_size: size of one head.
        total_num_heads: query heads over all ranks (divisible by tp).
        total_num_kv_heads: kv heads over all ranks (default ``total_num_heads``); it must divide
            ``total_num_heads``, and either ``tp % total_num_kv_heads == 0`` or
            ``total_num_kv_heads % tp == 0``.

    Attributes:
        num_heads, num_kv_heads: heads per rank; num_kv_head_replicas: ranks sharing a kv head;
        q_size = num_heads * head_size; kv_size = num_kv_heads * head_size.

    ``weight_loader(param, t, "q"|"k"|"v")`` takes the full ``[total_num_heads * head_size, hidden]``
    (q) or ``[total_num_kv_heads * head_size, hidden]`` (k, v) tensor; ``None`` takes the fused
    ``[(total_num_heads + 2 * total_num_kv_heads) * head_size, hidden]`` tensor.

    Raises:
        ValueError: any of the divisibility rules above is broken.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: Optional[int] = None, bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, quantize: bool = True):
        name = type(self).__name__
        _positive_int(name, "head_size", head_size)
        _positive_int(name, "total_num_heads", total_num_heads)
        total_kv = total_num_heads if total_num_kv_heads is None else total_num_kv_heads
        _positive_int(name, "total_num_kv_heads", total_kv)
        LinearBase.__init__(self, hidden_size, (total_num_heads + 2 * total_kv) * head_size, params_dtype, quantize)
        tp, rank = self.tp_size, self.tp_rank
        if total_num_heads % total_kv:
            raise ValueError(f"{name}: total_num_heads={total_num_heads} is not a multiple of "
                             f"total_num_kv_heads={total_kv}")
        self.hidden_size, self.head_size = hidden_size, head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_kv
        self.num_heads = _divide(name, "total_num_heads", total_num_heads, tp)
        if tp >= total_kv:
            if tp % total_kv:
                raise ValueError(f"{name}: tensor-parallel size {tp} and total_num_kv_heads={total_kv}: "
                                 "one must divide the other")
            self.num_kv_heads, self.num_kv_head_replicas = 1, tp // total_kv
        else:
            if total_kv % tp:
                raise ValueError(f"{name}: total_num_kv_heads={total_kv} is not divisible by the "
                                 f"tensor-parallel size {tp} (and does not divide it either)")
            self.num_kv_heads, self.num_kv_head_replicas = total_kv // tp, 1
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        kv_start = (rank // self.num_kv_head_replicas) * self.kv_size
        shards = {
            "q": OutputShard(total_num_heads * head_size, rank * self.q_size, self.q_size, 0),
            "k": OutputShard(total_kv * head_size, kv_start, self.kv_size, self.q_size),
            "v": OutputShard(total_kv * head_size, kv_start, self.kv_size, self.q_size + self.kv_size),
        }
        self._init_column(shards, self.q_size + 2 * self.kv_size, bias, gather_output=False)

    def forward_kv(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``[k | v]`` columns of :meth:`forward` without computing ``q``: ``x [..., hidden]``
        -> ``[..., 2 * kv_size]`` in ``x``'s dtype (a KV-cache-only pass).

        The GEMM runs on the K/V rows of the local weight (``weight[q_size:]``, a view; the bias
        likewise). An FP8 block-scaled weight is sliced with its ``weight_scale_inv`` rows when
        ``q_size`` falls on a scale row boundary (``scale_block_n`` divides it; always with per-row
        scales); otherwise the full projection runs and ``q`` is dropped. Each output element is the
        same dot product as in :meth:`forward`: bit-equal where the GEMM's reduction order does not
        depend on the number of output columns (the CPU torch paths); the FP8 Triton kernel's split-K
        choice does, so there it may differ from :meth:`forward` in fp32 summation order.

        Raises:
            ValueError: wrong last dimension. TypeError: ``x.dtype`` differs from the weight's.
        """
        self._check_input(x, self.input_size)
        q = self.q_size
        bias = self.bias[q:] if self.bias is not None else None
        if self.fp8_block is None:
            return F.linear(x, self.weight[q:], bias)
        if q % self.scale_block_n:  # the q / k boundary cuts a scale block: no exact row slice
            return self._linear(x, self.bias)[..., q:]
        return fp8_block_linear(x, self.weight[q:], self.weight_scale_inv[q // self.scale_block_n:],
                                self.scale_block_n, self.fp8_block[1], bias)


class RowParallelLinear(LinearBase):
    """``y = x W^T + b`` with ``W``'s input columns split across ranks and partial sums reduced.

    Rank ``r`` holds columns ``[r * input_size / tp, (r + 1) * input_size / tp)`` of ``W`` and the
    full bias. The bias is added by rank 0 only, before any reduction, so the sum over ranks
    contains it exactly once, whether this layer reduces (``reduce_results=True``) or the caller
    does (``reduce_results=False``, e.g. a fused all-reduce + RMSNorm: ranks return un-reduced
    partial sums whose sum over ranks is the layer's output).

    Args:
        input_size, output_size: full sizes; ``input_size`` must be divisible by tp.
        bias: add a ``[output_size]`` bias (replicated; added on rank 0).
        input_is_parallel: the input is already this rank's ``[..., input_size / tp]`` slice;
            if False the input is the full ``[..., input_size]`` and this rank slices it.
        reduce_results: all-reduce the output; if False return this rank's partial sum.
        params_dtype: parameter dtype (default ``torch.get_default_dtype()``).

    Raises:
        ValueError: non-positive sizes or ``input_size % tp != 0``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, input_is_parallel: bool = True,
                 reduce_results: bool = True, params_dtype: Optional[torch.dtype] = None, quantize: bool = True):
        super().__init__(input_size, output_size, params_dtype, quantize)
        self.input_size_per_partition = _divide(type(self).__name__, "input_size", input_size, self.tp_size)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self._new_weight(output_size, self.input_size_per_partition)
        self.bias = self._new_param(output_size) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: Optional[Any] = None) -> None:
        """Weight: full ``[output_size, input_size]``, keeps this rank's columns. Bias: full ``[output_size]``.

        Raises:
            ValueError: a shard id was given or the full shape is wrong. TypeError: non-floating tensor.
        """
        if param.dim() == 1:
            default_weight_loader(param, loaded_weight, loaded_shard_id)
            return
        if loaded_shard_id is not None:
            raise ValueError(f"{type(self).__name__}: takes no loaded_shard_id, got {loaded_shard_id!r}")
        per = self.input_size_per_partition
        if self.fp8_block is not None:
            bn, bk = self.fp8_block
            check_column_cut(type(self).__name__, per, self.input_size, self.tp_size, bk)
            if param is self.weight_scale_inv:
                check_full_tensor(f"{type(self).__name__} weight_scale_inv", loaded_weight,
                                  (cdiv(self.output_size, bn), cdiv(self.input_size, bk)))
                copy_into(param.data, loaded_weight.narrow(1, self.tp_rank * per // bk, cdiv(per, bk)))
                return
        check_full_tensor(f"{type(self).__name__} weight", loaded_weight, (self.output_size, self.input_size))
        copy_into(param.data, loaded_weight.narrow(1, self.tp_rank * per, per))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., input_size / tp]`` (or ``[..., input_size]`` if not input_is_parallel) -> ``[..., output_size]``.

        Returns the all-reduced output, or this rank's partial sum when ``reduce_results=False``.

        Raises:
            ValueError: wrong last dimension. TypeError: ``x.dtype`` differs from the weight's.
        """
        if self.input_is_parallel:
            self._check_input(x, self.input_size_per_partition)
        else:
            self._check_input(x, self.input_size)
            per = self.input_size_per_partition
            x = x.narrow(-1, self.tp_rank * per, per)
        y = self._linear(x, self.bias if self.tp_rank == 0 else None)
        return tensor_model_parallel_all_reduce(y) if self.reduce_results else y

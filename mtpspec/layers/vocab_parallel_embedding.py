"""Vocab-parallel embedding and LM head (Megatron-LM's vocab split; vLLM's names and padding).

The vocab of ``V`` rows is padded so each of the ``tp`` ranks holds
``per_rank = ceil(V / (64 * tp)) * 64`` rows; rank ``r`` holds padded ids
``[r * per_rank, (r + 1) * per_rank)``. Ids ``>= V`` are padding: their rows are zero and they
never win an argmax (see :mod:`mtpspec.layers.logits_processor`). The real rows of a shard are
a prefix of it; the last shards may be mostly or entirely padding.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from mtpspec.distributed import (
    get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce)
from mtpspec.layers.weight_utils import check_full_tensor, copy_into

PADDING_ALIGNMENT = 64


def pad_vocab_size(vocab_size: int, tp_size: int, alignment: int = PADDING_ALIGNMENT) -> int:
    """Padded vocab size ``ceil(vocab_size / (alignment * tp_size)) * alignment * tp_size``."""
    unit = alignment * tp_size
    return -(-vocab_size // unit) * unit


def _validate_default() -> bool:
    return os.environ.get("MTPSPEC_VALIDATE_IDS", "0") not in ("", "0")


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split across TP ranks; the output is all-reduced.

    Each rank embeds the ids that fall in its real rows, writes zeros for every other id, and the
    all-reduce sums the ranks' outputs (exactly one rank contributes a non-zero row per id, so the
    sum is exact in any dtype).

    Args:
        num_embeddings: vocab size ``V`` (>= 1).
        embedding_dim: hidden size ``H`` (>= 1).
        params_dtype: weight dtype (default ``torch.get_default_dtype()``).
        validate_ids: checking ids against ``[0, V)`` costs a reduction and, on an accelerator,
            a device-to-host sync of one bool per call. ``None`` (default) checks CPU inputs
            (no sync there) and skips accelerator inputs unless ``MTPSPEC_VALIDATE_IDS=1`` is set;
            ``True`` always checks; ``False`` never does. Unchecked out-of-range ids (negative or
            ``>= V``) are masked on every rank, so they embed to zeros (never an out-of-bounds read).

    Attributes:
        org_vocab_size: ``V``. num_embeddings_padded: ``tp * per_rank``.
        num_embeddings_per_partition: ``per_rank``. vocab_start_index / vocab_end_index: this
        rank's padded id range ``[start, end)``. num_real_embeddings_per_partition: real
        (non-padding) rows in this shard, ``clamp(V - start, 0, per_rank)``.
        weight: ``[per_rank, H]``; rows ``>= num_real_embeddings_per_partition`` are zero after loading.

    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: Optional[torch.dtype] = None,
                 *, validate_ids: Optional[bool] = None):
        super().__init__()
        name = type(self).__name__
        for n, v in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: {n} must be an int >= 1, got {v!r}")
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.org_vocab_size = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.num_real_embeddings_per_partition = max(
            0, min(num_embeddings - self.vocab_start_index, self.num_embeddings_per_partition))
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.validate_ids = validate_ids
        self.weight = nn.Parameter(torch.zeros(self.num_embeddings_per_partition, embedding_dim,
                                               dtype=self.params_dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: Optional[object] = None) -> None:
        """Keep this rank's rows of the full ``[V, H]`` checkpoint tensor; padding rows become zero.

        Raises:
            ValueError: a shard id was given, or the shape is not ``[V, H]``. TypeError: non-floating.
        """
        if loaded_shard_id is not None:
            raise ValueError(f"{type(self).__name__}: takes no loaded_shard_id, got {loaded_shard_id!r}")
        check_full_tensor(f"{type(self).__name__} weight", loaded_weight, (self.org_vocab_size, self.embedding_dim))
        n = self.num_real_embeddings_per_partition
        if n:  # a trailing rank may hold only padding
            copy_into(param.data[:n], loaded_weight.narrow(0, self.vocab_start_index, n))
        param.data[n:].zero_()

    def check_ids(self, input_ids: torch.Tensor) -> None:
        """Raise ``ValueError`` if any id is outside ``[0, V)`` (one ``.any()``; syncs on accelerators)."""
        bad = (input_ids < 0) | (input_ids >= self.org_vocab_size)
        if bool(bad.any()):
            first = int(input_ids[bad].flatten()[0])
            raise ValueError(f"{type(self).__name__}: token id {first} is out of range "
                             f"[0, {self.org_vocab_size}) ({int(bad.sum())} bad ids)")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embed ``input_ids`` (any shape ``[...]``, integer dtype) to ``[..., H]`` in ``params_dtype``.

        Raises:
            TypeError: ``input_ids`` is not an integer tensor.
            ValueError: an id is outside ``[0, V)`` (when validated; see ``validate_ids``).
        """
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise TypeError(f"{type(self).__name__}: input_ids must be an integer tensor, got {input_ids.dtype}")
        validate = self.validate_ids
        if validate is None:
            validate = input_ids.device.type == "cpu" or _validate_default()
        if validate:
            self.check_ids(input_ids)
        start = self.vocab_start_index
        mask = (input_ids >= start) & (input_ids < start + self.num_real_embeddings_per_partition)
        local = torch.where(mask, input_ids - start, torch.zeros_like(input_ids))
        out = F.embedding(local, self.weight).masked_fill(~mask.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.org_vocab_size}, embedding_dim={self.embedding_dim}, "
                f"per_partition={self.num_embeddings_per_partition}, tp_size={self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, sharded like :class:`VocabParallelEmbedding` (weight ``[per_rank, H]``).

    It is not called directly: :class:`~mtpspec.layers.logits_processor.LogitsProcessor` computes
    logits (``compute_logits``) or greedy tokens (``get_top_tokens``) from it.

    Args:
        num_embeddings, embedding_dim, params_dtype: as for the embedding.
        bias: add a bias ``[per_rank]``, loaded from the full ``[V]`` tensor (padding entries zero).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None):
        super().__init__(num_embeddings, embedding_dim, params_dtype)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.num_embeddings_per_partition, dtype=self.params_dtype),
                                     requires_grad=False)
            self.bias.weight_loader = self.bias_loader
        else:
            self.register_parameter("bias", None)

    def bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                    loaded_shard_id: Optional[object] = None) -> None:
        """Keep this rank's entries of the full ``[V]`` bias; padding entries become zero."""
        if loaded_shard_id is not None:
            raise ValueError(f"{type(self).__name__}: takes no loaded_shard_id, got {loaded_shard_id!r}")
        check_full_tensor(f"{type(self).__name__} bias", loaded_weight, (self.org_vocab_size,))
        n = self.num_real_embeddings_per_partition
        if n:  # a trailing rank may hold only padding
            copy_into(param.data[:n], loaded_weight.narrow(0, self.vocab_start_index, n))
        param.data[n:].zero_()

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> "ParallelLMHead":
        """Share ``embed_tokens.weight`` (same object: loading either loads both). Returns ``self``.

        Raises:
            ValueError: vocab size, hidden size or TP sharding differ.
        """
        if (embed_tokens.org_vocab_size, embed_tokens.embedding_dim, embed_tokens.tp_size) != \
                (self.org_vocab_size, self.embedding_dim, self.tp_size):
            raise ValueError(f"tie_weights: embedding (V={embed_tokens.org_vocab_size}, H={embed_tokens.embedding_dim}, "
                             f"tp={embed_tokens.tp_size}) does not match lm head (V={self.org_vocab_size}, "
                             f"H={self.embedding_dim}, tp={self.tp_size})")
        self.weight = embed_tokens.weight
        return self

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not called directly; use LogitsProcessor.compute_logits "
                           "or LogitsProcessor.get_top_tokens")

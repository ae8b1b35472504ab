"""Model layers: RMSNorm, tensor-parallel linears, vocab-parallel embedding / LM head, logits."""

from mtpspec.layers.layernorm import RMSNorm
from mtpspec.layers.linear import (
    ColumnParallelLinear, LinearBase, MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
    RowParallelLinear)
from mtpspec.layers.logits_processor import LogitsProcessor, local_top_pairs, pick_top_tokens
from mtpspec.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding, pad_vocab_size

__all__ = [
    "ColumnParallelLinear", "LinearBase", "LogitsProcessor", "MergedColumnParallelLinear", "ParallelLMHead",
    "QKVParallelLinear", "RMSNorm", "ReplicatedLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "local_top_pairs", "pad_vocab_size", "pick_top_tokens",
]

"""Fused kernels (Triton) and their torch references."""

from mtpspec.ops.argmax import (local_argmax, local_argmax_ref, local_top_pairs, local_top_pairs_ref,
                                pick_top_tokens, pick_top_tokens_ref)
from mtpspec.ops.eh_norm import fused_eh_norm, fused_eh_norm_ref
from mtpspec.ops.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from mtpspec.ops.triton_utils import use_triton

__all__ = [
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "fused_eh_norm",
    "fused_eh_norm_ref",
    "local_argmax",
    "local_argmax_ref",
    "local_top_pairs",
    "local_top_pairs_ref",
    "pick_top_tokens",
    "pick_top_tokens_ref",
    "rms_norm",
    "rms_norm_ref",
    "use_triton",
]

"""Fused kernels (Triton) and their torch references."""

from mtpspec.ops.rms_norm import fused_add_rms_norm_ref, rms_norm_ref

__all__ = ["fused_add_rms_norm_ref", "rms_norm_ref"]

"""Sampling and verification (vLLM's ``vllm/v1/sample``).

``sampler``: temperature / top-k / top-p and seeded inverse-CDF draws (``Sampler``,
``SamplingMetadata``); ``rejection_sampler``: verification of draft tokens (accepted /
recovered / bonus); ``counter_rng``: the counter-based uniforms both draw from (same on every rank).
"""

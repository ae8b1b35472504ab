"""Training recipe for small GLM-4.5-style models with MTP layers (the bundled demo model), and for
GLM-5-architecture models (``--arch glm_moe_dsa``).

Modules: ``word_problems`` (seeded generator of GSM8K-style problems), ``tokenizer`` (byte-level
BPE), ``corpus`` / ``packing`` (documents and length-bucketed batches), ``mtp_loss`` (DeepSeek-V3
eqs. 21-25), ``model_setup``, ``dsa`` (training-time DeepSeek Sparse Attention and the indexer's KL
objective), ``optim``, ``step``, ``quick_eval`` and ``train`` (``python -m
mtpspec.training.train`` / ``mtpspec train``). The GSM8K data and its lm-eval 5-shot text format
live in :mod:`mtpspec.data.gsm8k` (shared with eval, bench and generate; inference never imports
this package). Nothing heavy is imported here, so ``word_problems`` stays cheap to import in
worker processes.
"""

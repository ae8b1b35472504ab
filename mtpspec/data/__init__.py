"""Data sets that ship with mtpspec (no training code, nothing heavy imported).

``gsm8k``: GSM8K (MIT licence, bundled verbatim in ``mtpspec/data/gsm8k/``), its lm-eval 5-shot
text format, and :func:`mtpspec.data.gsm8k.resolve_gsm8k` (data flag, else
``$MTPSPEC_GSM8K_DIR``, else the bundled copy), used by eval, bench, generate and training.
"""

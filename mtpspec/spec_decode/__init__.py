"""Speculative decoding: how drafts are proposed (``proposer`` interface + registry,
``mtp_proposer``, ``draft_forward``), counted (``metrics``) and, for synthetic A/B runs, forced
(``forced_acceptance``). Verification lives in :mod:`mtpspec.sample.rejection_sampler`. Nothing
here imports :mod:`mtpspec.engine`."""

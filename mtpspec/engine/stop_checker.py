"""Appending a step's tokens to a sequence, stopping on EOS / stop ids / stop strings / lengths."""

from __future__ import annotations

from typing import Collection, Sequence as Seq

from mtpspec.engine.sequence import Sequence


def append_tokens(seq: Sequence, token_ids: Seq[int], eos_token_ids: Collection[int], max_model_len: int) -> int:
    """Append ``token_ids`` one at a time; stop at the first that finishes the request.

    ``eos_token_ids``: the model's EOS ids (any of them ends the request).

    Order of checks per token (after appending it): EOS (unless ``ignore_eos``) or a stop token
    id -> ``"stop"`` (the id stays in ``output_token_ids``; its text is added only with
    ``include_stop_str_in_output``, as vLLM's detokenizer does); a stop string in
    the text -> ``"stop"`` (text cut before it, or after it with ``include_stop_str_in_output``); ``max_tokens`` reached or the sequence
    reached ``max_model_len`` -> ``"length"``. Tokens after the finishing one are dropped.

    ``min_tokens`` (vLLM's rules): EOS and stop ids do not stop the request while it has fewer
    than ``min_tokens`` output tokens (the sampler masks them then anyway), and stop strings are
    looked for only once it has more than ``min_tokens``, in text that includes at least one
    character of a later token. Each stop string is searched from ``len(s) - 1`` characters
    before the newly added text, so it matches only if it ends in the new text.

    Returns:
        How many of ``token_ids`` were kept.
    """
    p = seq.params
    stops = p.stop_strings
    for i, tok in enumerate(token_ids):
        seq.output_token_ids.append(int(tok))
        n_out = len(seq.output_token_ids)
        is_eos = tok in eos_token_ids and not p.ignore_eos
        if n_out >= p.min_tokens and (is_eos or (p.stop_token_ids and tok in p.stop_token_ids)):
            seq.finish_reason = "stop"
            seq.stop_reason = None if is_eos else int(tok)
            if p.include_stop_str_in_output and seq.detokenizer is not None:
                seq.output_text += seq.detokenizer.add(int(tok))  # EOS: "" unless special tokens are kept
            return i + 1
        if seq.detokenizer is not None:
            before = len(seq.output_text)
            seq.output_text += seq.detokenizer.add(int(tok))
            if stops and len(seq.output_text) > before and n_out > p.min_tokens:
                hits = [(seq.output_text.find(s, max(0, before - len(s) + 1)), s) for s in stops]
                hits = [(pos, s) for pos, s in hits if pos >= 0]
                if hits:
                    pos, s = min(hits)
                    seq.output_text = seq.output_text[:pos + (len(s) if p.include_stop_str_in_output else 0)]
                    seq.finish_reason, seq.stop_reason = "stop", s
                    return i + 1
        if (p.max_tokens is not None and len(seq.output_token_ids) >= p.max_tokens) \
                or seq.num_tokens >= max_model_len:
            seq.finish_reason = "length"
            return i + 1
    return len(token_ids)

"""Token log-probabilities of a whole sequence by one extra target forward (for ``logprobs``/``echo``).

The engine's steps bring only token ids to the host, so log-probabilities are computed by a
separate scoring pass over ``prompt + completion`` with the target model, on every rank through
``collective_rpc`` (all ranks run the same forward and the same vocab all-gathers): one causal
forward without the KV cache (no forward context: plain causal attention over the sequence),
``compute_logits`` in chunks of rows, ``log_softmax`` in float32. Values are the raw model
distribution (temperature, top-p and top-k not applied), as OpenAI and vLLM report them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

# Rows of logits materialised at once ([rows, vocab] float32).
_CHUNK_ROWS = 256


@dataclass
class SequenceLogprobs:
    """Per-position scores of a token sequence ``t_0 .. t_{n-1}``.

    Attributes:
        token_logprobs: ``[n]``: ``log p(t_i | t_<i)``; ``None`` at ``i = 0`` (no context).
        top_token_ids, top_logprobs: ``[n]`` lists of the ``top_n`` most likely ids at position
            ``i`` given ``t_<i`` (most likely first); empty at ``i = 0`` and when ``top_n == 0``.
    """

    token_logprobs: List[Optional[float]]
    top_token_ids: List[List[int]]
    top_logprobs: List[List[float]]


@torch.inference_mode()
def score_on_rank(runner: Any, token_ids: Sequence[int], top_n: int) -> Optional[SequenceLogprobs]:
    """Run on every rank (``collective_rpc``); rank 0 returns the scores, the others ``None``.

    Args:
        runner: the rank's :class:`~mtpspec.engine.model_runner.ModelRunner`.
        token_ids: the sequence (length ``n >= 1``, ids below the vocab size).
        top_n: how many alternatives per position (``0 .. 20``).
    """
    from mtpspec.distributed import get_tp_group
    model = runner.target
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=runner.device)
    pos = torch.arange(ids.numel(), device=runner.device)
    hidden = model(ids, pos)
    chosen: List[Optional[float]] = [None]
    top_ids: List[List[int]] = [[]]
    top_vals: List[List[float]] = [[]]
    n = ids.numel()
    for start in range(0, n - 1, _CHUNK_ROWS):
        stop = min(n - 1, start + _CHUNK_ROWS)
        logp = torch.log_softmax(model.compute_logits(hidden[start:stop]).float(), dim=-1)
        nxt = ids[start + 1:stop + 1]
        chosen.extend(logp.gather(1, nxt.unsqueeze(1)).squeeze(1).tolist())
        if top_n > 0:
            v, i = logp.topk(min(top_n, logp.shape[-1]), dim=-1)
            top_ids.extend(i.tolist())
            top_vals.extend(v.tolist())
        else:
            top_ids.extend([] for _ in range(stop - start))
            top_vals.extend([] for _ in range(stop - start))
    if get_tp_group().rank_in_group != 0:
        return None
    return SequenceLogprobs(chosen, top_ids, top_vals)


def score_tokens(engine: Any, token_ids: Sequence[int], top_n: int = 0) -> SequenceLogprobs:
    """Scores of ``token_ids`` under the engine's target model (call between steps).

    Args:
        engine: an :class:`~mtpspec.engine.llm_engine.LLMEngine`.
        token_ids: the sequence; every id in ``[0, vocab_size)``; at most ``max_model_len`` ids.
        top_n: alternatives per position, ``0 .. 20``.

    Raises:
        ValueError: an empty sequence, an id out of range, too long, or ``top_n`` out of range.
    """
    ids = list(token_ids)
    if not ids:
        raise ValueError("cannot score an empty token sequence")
    if any(not 0 <= t < engine.vocab_size for t in ids):
        raise ValueError(f"token ids must be in [0, {engine.vocab_size})")
    if len(ids) > engine.scheduler_config.max_model_len:
        raise ValueError(f"{len(ids)} tokens exceed max_model_len={engine.scheduler_config.max_model_len}")
    if not 0 <= top_n <= 20:
        raise ValueError(f"logprobs (top alternatives) must be in [0, 20], got {top_n}")
    return engine.executor.collective_rpc(score_on_rank, ids, top_n)[0]

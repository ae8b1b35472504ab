"""Self-distillation data: the model's own greedy completions of GSM8K train questions.

Greedy speculative decoding accepts a draft when it equals the target's argmax *on the target's own
greedy continuation*, in the prompt format the evaluation uses. Training the MTP layer on text the
target wrote in that format (and not only on human-written solutions) moves its training
distribution to the one it is measured on. This is the self-distillation data of Medusa-2 (Cai et
al. 2024, "Medusa", sec. 3.3.2: the draft heads trained on the model's own outputs when the
original training data does not match it) and of EAGLE's ablation (Li et al. 2024, sec. 4.3.3),
here with greedy decoding and the evaluation's 5-shot prompt.

* Prompts (:func:`self_distill_prompts`): exactly ``mtpspec eval gsm8k``'s, the first
  ``num_shots`` train rows as shots, with train questions after those shots as the query (never a
  test question; the caller keeps its validation rows out).
* Documents (:func:`generate_documents`): prompt token ids + the completion's token ids, generated
  by :class:`mtpspec.LLM` (greedy, ``STOP_SEQUENCES``, ``max_tokens``), in waves until a time
  budget is used. A document is a :class:`~mtpspec.training.corpus.TokenDocs` row like any
  training document (source ``2``), so batching treats it the same way; its losses count from
  the last prompt position on (``TokenDocs.loss_start``): what the engine drafts is completions.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from mtpspec.training.corpus import TokenDocs

SELF_DISTILL_SOURCE = 2  # TokenDocs.source of a self-generated document


def self_distill_prompts(rows: Sequence[Dict[str, str]], num_shots: int) -> List[str]:
    """The evaluation's prompt (shots = ``rows[:num_shots]``) for every later row's question.

    Raises:
        ValueError: ``num_shots < 0`` or no row left after the shots.
    """
    from mtpspec.entrypoints.eval_gsm8k import build_prompts
    if num_shots < 0 or len(rows) <= num_shots:
        raise ValueError(f"need more than num_shots = {num_shots} GSM8K rows for self-distillation prompts, "
                         f"have {len(rows)}")
    return build_prompts(rows[num_shots:], rows, num_shots)


def docs_from_token_lists(seqs: Sequence[Sequence[int]], max_len: int,
                          prompt_lens: Optional[Sequence[int]] = None) -> TokenDocs:
    """``TokenDocs`` (source :data:`SELF_DISTILL_SOURCE`) of ``seqs``; sequences longer than
    ``max_len`` are dropped (counted in ``dropped``), as the corpus drops long documents.

    With ``prompt_lens`` (one per sequence), a document's losses count from position
    ``prompt_len - 1`` (``loss_start``): the last prompt position, whose MTP draft is the first
    the engine makes (it predicts the second completion token), and every completion position
    after it; the shared 5-shot prefix adds nothing there.

    Raises:
        ValueError: ``prompt_lens`` of another length than ``seqs``, or a prompt length outside
            ``[1, len(sequence)]``.
    """
    if prompt_lens is not None and len(prompt_lens) != len(seqs):
        raise ValueError(f"need one prompt length per sequence, got {len(prompt_lens)} for {len(seqs)}")
    keep = [i for i, s in enumerate(seqs) if 1 < len(s) <= max_len]
    kept = [np.asarray(seqs[i], dtype=np.int32) for i in keep]
    offsets = np.zeros(len(kept) + 1, dtype=np.int64)
    if kept:
        offsets[1:] = np.cumsum([len(s) for s in kept])
    tokens = np.concatenate(kept) if kept else np.zeros(0, dtype=np.int32)
    start = None
    if prompt_lens is not None:
        bad = [i for i in keep if not 1 <= prompt_lens[i] <= len(seqs[i])]
        if bad:
            raise ValueError(f"prompt length {prompt_lens[bad[0]]} of sequence {bad[0]} is outside [1, "
                             f"{len(seqs[bad[0]])}]")
        start = np.asarray([prompt_lens[i] - 1 for i in keep], dtype=np.int64)
    return TokenDocs(tokens, offsets, np.full(len(kept), SELF_DISTILL_SOURCE, dtype=np.int8),
                     dropped=len(seqs) - len(kept), loss_start=start)


def generate_documents(model: str, prompts: Sequence[str], max_tokens: int, max_seconds: float,
                       llm_kwargs: Optional[Dict[str, Any]] = None, wave: int = 1024,
                       log=None) -> Tuple[List[List[int]], List[int], Dict[str, Any]]:
    """Greedy completions of ``prompts`` by the model in folder ``model``, in waves of ``wave``
    prompts until ``max_seconds`` (wall clock after the engine is up, > 0) is used up: the first
    wave always runs, and the wave that crosses the budget is kept.

    Returns:
        ``(documents, prompt_lens, stats)``: one ``prompt_token_ids + completion token_ids`` list
        per prompt done, in prompt order, and its prompt's length; stats give the prompts done,
        tokens, seconds (generation; the engine's start-up apart) and the engine's acceptance length.

    Raises:
        ValueError: ``max_seconds <= 0`` or ``max_tokens < 1``.
    """
    from mtpspec import LLM, SamplingParams
    from mtpspec.entrypoints.eval_gsm8k import _release_device_memory
    from mtpspec.entrypoints.eval_gsm8k_score import STOP_SEQUENCES
    if not max_seconds > 0 or max_tokens < 1:
        raise ValueError(f"need max_seconds > 0 and max_tokens >= 1, got {max_seconds}, {max_tokens}")
    _release_device_memory()  # a training process's cached blocks would shrink the engine's KV cache
    t_start = time.time()
    llm = LLM(model=model, **(llm_kwargs or {}))
    t0 = time.time()  # the budget counts generation, not the engine's start-up
    docs: List[List[int]] = []
    prompt_lens: List[int] = []
    completion_tokens = 0
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=STOP_SEQUENCES)
        for start in range(0, len(prompts), wave):
            if start and time.time() - t0 >= max_seconds:
                break
            for o in llm.generate(list(prompts[start:start + wave]), params, use_tqdm=False):
                out = list(o.outputs[0].token_ids)
                completion_tokens += len(out)
                docs.append(list(o.prompt_token_ids) + out)
                prompt_lens.append(len(o.prompt_token_ids))
            if log is not None:
                log(f"self-distillation data: {len(docs)} of {len(prompts)} prompts, {time.time() - t0:.0f} s")
        metrics = llm.get_metrics()
    finally:
        llm.shutdown()
        del llm
        _release_device_memory()
    stats = {"prompts_done": len(docs), "prompts_offered": len(prompts), "completion_tokens": completion_tokens,
             "document_tokens": int(sum(len(d) for d in docs)), "seconds": round(time.time() - t0, 1),
             "engine_start_seconds": round(t0 - t_start, 1),
             "acceptance_length": metrics.get("acceptance_length")}
    return docs, prompt_lens, stats


class MixedBatches:
    """Endless batches drawing from ``self_batches`` with probability ``share`` (seeded), else
    from ``base_batches``: the self-distillation documents as ``share`` of the training batches."""

    def __init__(self, base_batches, self_batches, share: float, seed: int) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"--self-distill-share must be in [0, 1], got {share}")
        self.base, self.other, self.share = base_batches, self_batches, share
        self.rng = np.random.default_rng(seed + 17)

    def __iter__(self) -> "MixedBatches":
        return self

    def __next__(self):
        return next(self.other) if self.rng.random() < self.share else next(self.base)

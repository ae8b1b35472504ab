"""Per-rank executor of one engine step: prepare -> verify -> accept -> propose -> copy out.

Every tensor-parallel rank runs the same :meth:`ModelRunner.execute_model` on the same
:class:`~mtpspec.step_io.StepInput`. Logits are all-gathered and the random draws are
counter-based (:mod:`mtpspec.sample.counter_rng`), so every rank computes the same tokens and the
same accepted counts, hence the same shapes and the same collectives in the same order. A
step makes two device-to-host transfers: the ``[B, k + 1]`` token block right after
verification (with the step's log-probabilities packed beside it when a sequence asked for
them), then the ``[B, k]`` drafts after the proposer's passes (:meth:`ModelRunner.launch`:
the engine processes the tokens while the draft passes run).

Sampling and verification read the verify forward's logits after per-request edits
(:mod:`mtpspec.sample.logits_processors`: ``logit_bias``, ``min_tokens``, penalties);
log-probabilities (:mod:`mtpspec.sample.logprobs`) are scored from the unedited logits of the
same rows, on rank 0 only (the other ranks' step outputs are never read), so no forward runs
twice. Both happen eagerly after the (possibly graphed) verify forward.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from mtpspec.config import SpeculativeConfig
from mtpspec.distributed import comm_stats, get_tp_group
from mtpspec.engine import kv_cache
from mtpspec.engine.block_manager import blocks_with_watermark
from mtpspec.engine.config import CacheConfig, SchedulerConfig
from mtpspec.engine.forward import EagerForward, GraphedForward, prefill_capture_sizes
from mtpspec.engine.input_prep import prepare_step
from mtpspec.engine.scheduler import DRAFT_PENDING, TOKEN_PENDING
from mtpspec.ops.kv_quant import resolve_kv_cache_dtype
from mtpspec.sample.logits_processors import apply_logits_processors
from mtpspec.sample.logprobs import PROMPT_CHUNK_ROWS, score_rows, unpack_rows
from mtpspec.sample.gumbel import STREAM_RESIDUAL, row_hash
from mtpspec.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler, SampledDrafts
from mtpspec.sample.sampler import Sampler
from mtpspec.spec_decode.deferred_mtp import MTPHiddenStateCache, catch_up, catch_up_chunk_rows
from mtpspec.spec_decode.proposer import Proposer, build_proposer
from mtpspec.step_io import PreparedStep, StepInput, StepOutput


def _bytes_sent(stats: dict) -> dict:
    return {op: v["bytes_sent"] for op, v in stats.items()}


def _host_sync_layers(*models: Optional[torch.nn.Module]) -> bool:
    """Whether a model holds layers whose forward syncs with the host on a GPU (FP8 MoE experts
    whose block_k the grouped kernel does not take: :func:`mtpspec.ops.fp8_gemm.fp8_moe_experts`
    then loops over experts), so ``graph_mode="auto"`` stays eager."""
    from mtpspec.layers.fused_moe import FusedMoE
    from mtpspec.ops.fp8_gemm import kernel_supports
    return any(isinstance(m, FusedMoE) and m.fp8_block is not None and not kernel_supports(m.fp8_block[1])
               for model in models if model is not None for m in model.modules())


class ModelRunner:
    """Holds this rank's models and KV caches and executes steps.

    Args:
        target: the target model (``forward(input_ids, positions) -> [T, H]`` post-norm,
            ``compute_logits``).
        mtp: the MTP model or ``None`` (plain decoding).
        spec: the speculative config or ``None``.
        cache_config, scheduler_config: sizes.
        device: where the models live.
        max_position: the models' ``max_position_embeddings``.
        graph_mode: ``"auto"`` (CUDA graphs for pure-decode steps on a GPU, eager otherwise and for
            models whose FP8 MoE experts sync with the host: a block_k the grouped kernel does not
            take), ``"off"``, ``"cuda"`` or ``"static"`` (see
            :mod:`mtpspec.engine.forward`).

    Raises:
        ValueError: ``spec`` without an MTP model, or an unknown ``graph_mode`` / ``spec.method``.
        LocalArgmaxUnsupportedError: see :class:`~mtpspec.spec_decode.mtp_proposer.MTPProposer`.
    """

    def __init__(self, target: torch.nn.Module, mtp: Optional[torch.nn.Module], spec: Optional[SpeculativeConfig],
                 cache_config: CacheConfig, scheduler_config: SchedulerConfig, device: torch.device,
                 max_position: int, graph_mode: str = "auto"):
        self.target = target
        self.mtp = mtp
        self.k = spec.num_speculative_tokens if spec is not None else 0
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.device = device
        self.max_position = max_position
        self.kv_dtype = next(target.parameters()).dtype  # the model dtype (graph buffers)
        # what the caches store: the model dtype, or E4M3 under --kv-cache-dtype fp8
        self.cache_dtype = resolve_kv_cache_dtype(cache_config.cache_dtype, self.kv_dtype)
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        self.is_driver = get_tp_group().rank_in_group == 0  # the rank whose StepOutput is read
        self.proposer: Optional[Proposer] = None
        self.draft_sampling = spec is not None and spec.draft_sampling == "auto"
        self.adaptive = spec is not None and spec.adaptive  # steps may verify / propose 0 .. k drafts
        # The last step's drafts [B, k] (device) and request id -> their row: decodes whose drafts
        # the engine left as DRAFT_PENDING read them here (async scheduling); sampled drafts find
        # their q at that row of the proposer's SampledDraftState.
        self._draft_rows: dict = {}
        # plain decoding with async scheduling: the last step's sampled tokens [B] (device) and each
        # request's row in them, for the next step's TOKEN_PENDING inputs (_fill_pending_tokens)
        self._prev_tokens: Optional[torch.Tensor] = None
        self._token_rows: dict = {}
        self._prev_drafts: Optional[torch.Tensor] = None
        if spec is not None:
            if mtp is None:
                raise ValueError("speculative decoding needs the MTP model")
            self.proposer = build_proposer(spec, mtp, block_size=cache_config.block_size, max_position=max_position,
                                           max_num_seqs=scheduler_config.max_num_seqs)
        self.layers = kv_cache.attention_layers(target, mtp)
        # adaptive speculation that defers k = 0 steps' MTP KV writes: the target's hidden states of
        # those rows, paged like the KV caches (spec_decode/deferred_mtp.py)
        self.hidden_cache: Optional[MTPHiddenStateCache] = None
        self.num_mtp_catch_up_rows = 0  # deferred MTP entries written by catch-ups (a counter)
        self.catch_up_chunk_rows = 0  # rows of one catch-up chunk (deferred_mtp.catch_up_chunk_rows)
        if spec is not None and spec.defers_mtp_kv:
            self.hidden_cache = MTPHiddenStateCache(target.config.hidden_size, self.kv_dtype)
            self.layers.append(self.hidden_cache)
            self.catch_up_chunk_rows = catch_up_chunk_rows(scheduler_config.max_num_batched_tokens)
        self.num_blocks = 0
        if graph_mode == "auto":
            graph_mode = "cuda" if device.type == "cuda" and not _host_sync_layers(target, mtp) else "off"
        if graph_mode not in ("off", "cuda", "static"):
            raise ValueError(f"graph_mode must be 'auto', 'off', 'cuda' or 'static', got {graph_mode!r}")
        self.graph_mode = graph_mode
        self.fwd: EagerForward = EagerForward(target, mtp)
        if graph_mode != "off":
            sc = scheduler_config
            width = -(-sc.decode_slots(sc.max_model_len) // cache_config.block_size)
            self.fwd = GraphedForward(target, mtp, self.k, sc.max_num_seqs, width, target.config.hidden_size,
                                      self.kv_dtype, device, graph_mode, sc.decode_slots(sc.max_model_len),
                                      prefill_capture_sizes(sc.max_num_batched_tokens, sc.max_model_len),
                                      ks=range(self.k + 1) if self.adaptive else None,
                                      kv_only_units=self.hidden_cache is None)
            # pure-decode verify units write the rows' hidden states themselves (no eager launch a k = 0 step)
            self.fwd.hidden_sink = self.hidden_cache

    # ------------------------------------------------------------------ KV cache
    def max_useful_blocks(self) -> int:
        """Blocks for every sequence at full length, plus the block manager's watermark (without it a
        CPU cache capped here could not admit one sequence of ``max_model_len`` at ``max_num_seqs`` 1)."""
        sc = self.scheduler_config
        per_seq = -(-sc.decode_slots(sc.max_model_len) // self.cache_config.block_size)
        return blocks_with_watermark(sc.max_num_seqs * per_seq)

    @torch.inference_mode()
    def profile_and_count_blocks(self) -> int:
        """Blocks this rank can hold; on CUDA after a profiling forward of ``max_num_batched_tokens``
        tokens (and, where MTP entries are deferred, a KV-only pass over a catch-up chunk's rows:
        no cache is attached yet, so nothing is written)."""
        if self.device.type == "cuda" and self.cache_config.num_kv_blocks is None:
            n = min(self.scheduler_config.max_num_batched_tokens, self.max_position)
            ids = torch.zeros(n, dtype=torch.int64, device=self.device)
            pos = torch.arange(n, device=self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            hidden = self.target(ids, pos)
            # kept through the draft passes: a step's logits are alive while its MTP / catch-up passes run
            logits = self.target.compute_logits(hidden[: self.scheduler_config.max_num_seqs * (1 + self.k)])
            if self.mtp is not None:
                self.mtp(ids, pos, hidden, spec_step_idx=0)
            if self.catch_up_chunk_rows:
                c = self.catch_up_chunk_rows
                rows = torch.zeros(c, hidden.shape[-1], dtype=hidden.dtype, device=self.device)  # the cache read
                self.proposer.write_kv_rows(torch.zeros(c, dtype=torch.int64, device=self.device),
                                            torch.arange(c, device=self.device) % self.max_position, rows, None)
                del rows
            torch.cuda.synchronize(self.device)
            del hidden, logits
            torch.cuda.empty_cache()
        return kv_cache.available_kv_blocks(self.layers, self.cache_config, self.cache_dtype, self.device,
                                            self.max_useful_blocks())

    def init_kv_cache(self, num_blocks: int) -> None:
        """Attach ``num_blocks``-block caches to every target and MTP attention layer."""
        self.num_blocks = num_blocks
        kv_cache.allocate(self.layers, num_blocks, self.cache_config.block_size, self.cache_dtype, self.device)
        if isinstance(self.fwd, GraphedForward):
            self.fwd.capture(self.proposer)

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, step: StepInput) -> StepOutput:
        """Run one step: (block copies) -> prepare -> verify -> accept -> propose -> copy out.

        Returns:
            per sequence in batch order, the emitted tokens and the next ``k`` drafts, with the
            step's eager fall-backs, collective bytes and wall time.

        Raises:
            ValueError: a malformed ``step`` (see :func:`~mtpspec.engine.input_prep.prepare_step`).
        """
        pending = self.launch(step)
        out = pending.output()
        out.draft_token_ids = pending.drafts()
        out.catch_up_ms = pending.catch_up_ms()
        return out

    @torch.inference_mode()
    def launch(self, step: StepInput) -> "PendingStep":
        """Queue one step on the device and return before its drafts are known.

        The emitted tokens (and log-probabilities) are copied to the host right after
        verification, the drafts after the proposer's passes, each copy with its own event: a
        caller reads the tokens (:meth:`PendingStep.output`) while the draft passes still run,
        and the drafts (:meth:`PendingStep.drafts`) when it builds the next step. The device
        work and its order are those of :meth:`execute_model`; only where the host waits moves.

        Raises:
            ValueError: a malformed ``step`` (see :func:`~mtpspec.engine.input_prep.prepare_step`).
        """
        t0, comm0, fallbacks0 = time.perf_counter(), _bytes_sent(comm_stats()), self.fwd.num_eager_fallbacks
        v, p = self._step_ks(step)
        if step.block_copies:  # prefix caching: private copies of shared blocks, before any write
            kv_cache.copy_blocks(self.layers, step.block_copies, self.device)
        inp = self._prepare(step, v, p)
        hidden, logits = self.fwd.verify(inp.input_ids, inp.positions, inp.attn_metadata, inp.sample_rows)
        tokens, last_row = self._accept(inp, logits, self._sampled_drafts(step, inp))
        if v == 0:  # the next step may read these as its TOKEN_PENDING inputs (plain decoding, async)
            self._prev_tokens = tokens[:, 0]
            self._token_rows = {s.request_id: i for i, s in enumerate(step.seqs) if not s.is_partial_prefill}
        scores = self._score_logprobs(inp, hidden, logits, tokens)
        token_copy = _HostCopy.start(_pack_tokens(tokens, scores))
        timer = self._catch_up(step, inp, p)
        drafts = self._propose(step, inp, hidden, tokens, last_row, p)
        if drafts is not None:
            self._draft_rows = {s.request_id: i for i, s in enumerate(step.seqs) if not s.is_partial_prefill}
            self._prev_drafts = drafts
        draft_copy = None if drafts is None else _HostCopy.start(drafts.view(tokens.shape[0], p))
        comm1 = _bytes_sent(comm_stats())
        delta = {op: comm1[op] - comm0.get(op, 0) for op in comm1 if comm1[op] != comm0.get(op, 0)}
        return PendingStep(step, inp, tuple(tokens.shape), scores, token_copy, draft_copy,
                           self.fwd.num_eager_fallbacks - fallbacks0, delta, t0, timer)

    def _step_ks(self, step: StepInput) -> Tuple[int, int]:
        """``(drafts each decode verifies, drafts proposed)`` of ``step`` (default: ``k`` both).

        Raises:
            ValueError: either outside ``[0, k]``.
        """
        v = self.k if step.num_spec_tokens is None else step.num_spec_tokens
        p = self.k if step.num_proposed_tokens is None else step.num_proposed_tokens
        if not (0 <= v <= self.k and 0 <= p <= self.k):
            raise ValueError(f"step {step.step_id}: num_spec_tokens={v} and num_proposed_tokens={p} must be in "
                             f"[0, k={self.k}]")
        return v, p

    def _prepare(self, step: StepInput, v: int, p: int) -> PreparedStep:
        """Device tensors of ``step`` (``v`` drafts per decode, ``p`` proposed); tells the forward the
        batch (graph buffers for pure decodes)."""
        # draft temperatures: for this step's verification (v) and for the drafts it proposes (p)
        inp = prepare_step(step, v, self.cache_config.block_size, self.max_position, self.device,
                           self.draft_sampling and (v > 0 or p > 0))
        self._fill_pending_drafts(step, inp)
        self._fill_pending_tokens(step, inp)
        self.fwd.begin_step(step.is_pure_decode, len(step.seqs), inp.block_tables, inp.input_ids.shape[0],
                            inp.sample_rows.shape[0], k=v)
        return inp

    def _fill_pending_drafts(self, step: StepInput, inp: PreparedStep) -> None:
        """Decodes whose drafts are :data:`~mtpspec.engine.scheduler.DRAFT_PENDING` (async scheduling:
        the engine built this step before the last one's drafts reached the host) take them from
        the last step's device tensor, into their input rows and ``inp.draft_token_ids`` (device
        copies, queued before this step's forward; no host wait).

        Raises:
            RuntimeError: a pending decode that the last step did not draft for.
        """
        nd, k = inp.num_decodes, inp.k
        pend = [i for i, s in enumerate(step.seqs[:nd]) if s.input_token_ids[1] == DRAFT_PENDING]
        if not pend:
            return
        missing = [step.seqs[i].request_id for i in pend if step.seqs[i].request_id not in self._draft_rows]
        if missing or self._prev_drafts is None:
            raise RuntimeError(f"decodes {missing} wait for drafts the last step did not compute on this rank")
        rows = [self._draft_rows[step.seqs[i].request_id] for i in pend]
        if rows == pend and pend[-1] == len(pend) - 1:  # steady state: the same leading rows, no index tensors
            n = len(pend)
            inp.draft_token_ids[:n].copy_(self._prev_drafts[:n, :k])
        else:
            src = self._prev_drafts[:, :k].index_select(0, torch.tensor(rows, dtype=torch.int64).to(self.device,
                                                                                             non_blocking=True))
            dst = torch.tensor(pend, dtype=torch.int64).to(self.device, non_blocking=True)
            inp.draft_token_ids.index_copy_(0, dst, src)
        ids = inp.input_ids[: nd * (k + 1)].view(nd, k + 1)
        ids[:, 1:] = inp.draft_token_ids

    def _fill_pending_tokens(self, step: StepInput, inp: PreparedStep) -> None:
        """Decodes whose input is :data:`~mtpspec.engine.scheduler.TOKEN_PENDING` (plain decoding
        with async scheduling: scheduled before the last step's tokens reached the host) take the
        token the last step sampled for them, from its device tensor (a device copy queued before
        this step's forward; no host wait).

        Raises:
            RuntimeError: a pending decode that the last step sampled no token for on this rank.
        """
        pend = [i for i, s in enumerate(step.seqs) if not s.is_prefill and s.input_token_ids[0] == TOKEN_PENDING]
        if not pend:
            return
        rows = [self._token_rows.get(step.seqs[i].request_id, -1) for i in pend]
        if self._prev_tokens is None or min(rows) < 0:
            missing = [step.seqs[i].request_id for i, r in zip(pend, rows) if r < 0]
            raise RuntimeError(f"decodes {missing} wait for tokens the last step did not sample on this rank")
        n = len(pend)
        if rows == pend and pend[-1] == n - 1:  # steady state: the same leading one-row decodes
            inp.input_ids[:n].copy_(self._prev_tokens[:n])
            return
        first_row = np.concatenate([[0], np.cumsum(inp.host_query_lens)])[pend]  # each sequence's first row
        src = self._prev_tokens.index_select(
            0, torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True))
        at = torch.from_numpy(first_row.astype(np.int64)).to(self.device, non_blocking=True)
        inp.input_ids.index_copy_(0, at, src)

    def _sampled_drafts(self, step: StepInput, inp: PreparedStep) -> Optional[SampledDrafts]:
        """The draft distributions of this step's decodes whose drafts were sampled, or ``None``.

        Read from the proposer's persistent buffers at the rows the previous step drafted them
        in (before this step's drafting overwrites them). A decode whose drafts were not drafted
        by the previous step (it sat a step out) or do not match the recorded ones is marked
        ``ignore``: its drafts are not verified and it samples plainly (exact). Decided on the
        host from the ``StepInput`` alone, so every rank issues the same collectives.
        """
        nd = inp.num_decodes
        if not self.draft_sampling or not nd or inp.draft_temperature is None:
            return None
        decodes = step.seqs[:nd]
        mask_host = [s.draft_temperature > 0 for s in decodes]
        if not any(mask_host):
            return None
        st = self.proposer.sampled
        rows_host = [self._draft_rows.get(s.request_id, -1) if m else -1 for s, m in zip(decodes, mask_host)]
        dev = self.device
        mask = torch.tensor(mask_host, dtype=torch.bool).to(dev, non_blocking=True)
        rows = torch.tensor(rows_host, dtype=torch.int64).to(dev, non_blocking=True)
        known = rows >= 0
        idx = rows.clamp(min=0)
        if self._prev_drafts is not None and self._prev_drafts.shape[0] > 0:
            prev = self._prev_drafts.index_select(0, idx.clamp(max=self._prev_drafts.shape[0] - 1))
            known = known & (prev[:, :inp.k] == inp.draft_token_ids).all(dim=1)
        else:
            known = torch.zeros_like(known)
        k = inp.k
        pos = (inp.start_positions[:nd].unsqueeze(1) + 1 + torch.arange(k, device=dev)).reshape(-1)
        res_rows = row_hash(inp.draft_seed_keys[:nd].repeat_interleave(k), pos, STREAM_RESIDUAL).view(nd, k)
        v0, nr = self.mtp.local_vocab_range(0)
        return SampledDrafts(mask & known, mask & ~known, st.local_logits[:k].index_select(1, idx).transpose(0, 1), v0,
                             nr, inp.draft_temperature[:nd], st.log_q[:, :k].index_select(0, idx),
                             st.lse[:, :k].index_select(0, idx), res_rows)

    def _accept(self, inp: PreparedStep, logits: torch.Tensor,
                sampled: Optional[SampledDrafts] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Verify the decodes' drafts (rejection sampler) and sample the prefills (sampler).

        Returns:
            tokens ``[B, k + 1]`` int64 (:data:`PLACEHOLDER_TOKEN_ID`-padded; all placeholders for
            a partial prefill chunk, which samples nothing) and each sequence's last valid row
            offset ``[B]`` int64 (accepted drafts; ``q - 1`` for a prefill or a chunk).
            ``sampled``: the decodes' sampled-draft distributions (:meth:`_sampled_drafts`).
        """
        k = inp.k
        nd, npf = inp.num_decodes, inp.num_prefills
        parts, last = [], []
        logits = apply_logits_processors(logits, inp.logits_meta)
        if nd:
            dec_logits = logits[: nd * (k + 1)].view(nd, k + 1, -1)
            res = self.rejection_sampler(inp.draft_token_ids, dec_logits, inp.decode_meta, inp.accept_uniforms,
                                         inp.decode_sample_uniforms, sampled=sampled)
            parts.append(res.output_token_ids)
            last.append(res.num_accepted)
        if npf:
            pre_logits = logits[nd * (k + 1):]
            if inp.prefill_sample_index is None:
                sampled = self.sampler(pre_logits, inp.prefill_meta, inp.prefill_uniforms)
            else:  # partial chunks: placeholders; the sampled prefills' tokens scattered in between
                sampled = torch.full((npf,), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=logits.device)
                if pre_logits.shape[0]:
                    sampled[inp.prefill_sample_index] = self.sampler(pre_logits, inp.prefill_meta,
                                                                     inp.prefill_uniforms)
            pad = sampled.new_full((npf, k), PLACEHOLDER_TOKEN_ID)
            parts.append(torch.cat([sampled.unsqueeze(1), pad], dim=1))
            q = torch.tensor(inp.host_query_lens[nd:], dtype=torch.int64)
            last.append((q - 1).to(self.device, non_blocking=True))
        if len(parts) == 1:  # a pure-decode (or pure-prefill) step: no concatenation launches
            return parts[0], last[0]
        return torch.cat(parts), torch.cat(last)

    def _catch_up(self, step: StepInput, inp: PreparedStep, p: int) -> Optional["_CatchUpTimer"]:
        """A step proposing ``p >= 1`` drafts first writes its sequences' deferred MTP entries
        (:func:`~mtpspec.spec_decode.deferred_mtp.catch_up`); returns the pass's timer (the adaptive
        policy learns what an entry costs from it), ``None`` where there was nothing to catch up.

        Raises:
            ValueError: deferred entries on a runner without the hidden-state cache, or a malformed
                lag (:func:`~mtpspec.spec_decode.deferred_mtp.lag_rows`).
        """
        if self.proposer is None or p == 0 or not any(s.mtp_lag for s in step.seqs):
            return None
        if self.hidden_cache is None:
            raise ValueError(f"step {step.step_id} asks for deferred MTP entries, but this runner keeps no "
                             "hidden states")
        timer = _CatchUpTimer(self.device)
        self.num_mtp_catch_up_rows += catch_up(step, inp, self.hidden_cache, self.proposer.write_kv_rows,
                                               self.cache_config.block_size, self.catch_up_chunk_rows)
        return timer.stop()

    def _propose(self, step: StepInput, inp: PreparedStep, hidden: torch.Tensor, tokens: torch.Tensor,
                 last_row: torch.Tensor, p: int) -> Optional[torch.Tensor]:
        """The next ``p`` drafts ``[B, p]`` int64 from the proposer, or ``None`` without one or
        with ``p = 0`` (then only the draft model's KV caches are written:
        :meth:`~mtpspec.spec_decode.proposer.Proposer.write_kv_only`; or, when the step defers
        them, only the rows' hidden states are kept: :mod:`mtpspec.spec_decode.deferred_mtp`).
        (With ``p >= 1`` the sequences' deferred MTP entries were written first: :meth:`_catch_up`.)

        A partial prefill chunk's newest token is the prompt token after it
        (``inp.next_token_ids``): the MTP first pass writes the same KV entries as a whole
        prefill; the drafts it yields are dropped by :meth:`PendingStep.drafts`.

        Raises:
            ValueError: a step that defers its MTP entries on a runner without the hidden-state cache.
        """
        if self.proposer is None:
            return None
        if p == 0 and step.defer_mtp_kv:
            if self.hidden_cache is None:
                raise ValueError(f"step {step.step_id} defers its MTP KV entries, but this runner keeps no hidden "
                                 "states (speculative_config adaptive with adaptive_defer_mtp_kv)")
            if not self.fwd.wrote_hidden:  # (a graphed pure-decode verify wrote them: GraphedForward.hidden_sink)
                self.hidden_cache.write(hidden, inp.attn_metadata.slot_mapping)
            return None
        if p == 0 and inp.k == 0 and inp.next_token_ids is None and tokens.shape[0] == inp.input_ids.shape[0]:
            # one row per sequence (plain-decoding layout): each row's next id is its sampled token
            self.proposer.write_kv_only(inp, hidden, tokens[:, 0], None, self.fwd)
            return None
        new_tok = tokens.gather(1, last_row_tok_index(inp, last_row).unsqueeze(1)).squeeze(1)
        if inp.next_token_ids is not None:
            new_tok = torch.where(inp.next_token_ids >= 0, inp.next_token_ids, new_tok)
        if p == 0:
            self.proposer.write_kv_only(inp, hidden, new_tok, last_row, self.fwd)
            return None
        host_last = last_row.tolist() if self.device.type == "cpu" else None
        return self.proposer.propose(inp, hidden, new_tok, last_row, host_last, self.fwd, k=p,
                                     split_prefill=self.fwd.eager_first_pass())

    def _score_logprobs(self, inp: PreparedStep, hidden: torch.Tensor, logits: torch.Tensor,
                        tokens: torch.Tensor) -> Optional[List[torch.Tensor]]:
        """Packed ``[sample block, prompt block]`` (:func:`~mtpspec.sample.logprobs.score_rows`) on
        the driver rank, ``None`` elsewhere or when no sequence asked.

        Emitted tokens are scored from the unedited ``logits`` rows they were sampled from;
        prompt rows go through ``compute_logits`` in chunks on every rank (it all-gathers the
        vocab shards), the scoring itself only on the driver.
        """
        lm = inp.logprobs_meta
        if lm is None:
            return None
        sample = prompt = None
        if lm.rows is not None and self.is_driver:
            chosen = tokens.reshape(-1).index_select(0, lm.token_index)
            sample = score_rows(logits.index_select(0, lm.rows), chosen, lm.num_top)
        if lm.prompt_rows is not None:
            chunks = []
            for a in range(0, lm.prompt_rows.shape[0], PROMPT_CHUNK_ROWS):
                rows = lm.prompt_rows[a:a + PROMPT_CHUNK_ROWS]
                chunk_logits = self.target.compute_logits(hidden.index_select(0, rows))
                if self.is_driver:
                    chunks.append(score_rows(chunk_logits, lm.prompt_tokens[a:a + PROMPT_CHUNK_ROWS], lm.prompt_num_top))
            prompt = torch.cat(chunks) if chunks else None
        if not self.is_driver:
            return None
        return [sample, prompt]

def last_row_tok_index(inp: PreparedStep, last_row: torch.Tensor) -> torch.Tensor:
    """Column of each sequence's newest token in the ``[B, k + 1]`` token block.

    Decodes: ``num_accepted``; prefills (and every row in plain decoding): column 0.
    """
    if inp.num_decodes >= last_row.shape[0]:  # every row a decode (pure-decode steps): no copy, no fill
        return last_row
    idx = last_row.clone()
    idx[inp.num_decodes:] = 0
    return idx


def _split_logprobs(step: StepInput, lm, new_tokens: List[List[int]], blocks: List[Optional[np.ndarray]]):
    """Per sequence: the emitted tokens' and the prompt rows' :class:`TokenLogprobs` (or ``None``);
    ``lm``: the step's ``PreparedStep.logprobs_meta``."""
    sample, prompt = blocks
    out_s: List = [None] * len(step.seqs)
    out_p: List = [None] * len(step.seqs)
    a = b = 0
    for i, s in enumerate(step.seqs):
        n = lm.row_counts[i]
        if n:
            out_s[i] = unpack_rows(sample[a:a + len(new_tokens[i])], s.logprobs)
            a += n
        n = lm.prompt_row_counts[i]
        if n:
            out_p[i] = unpack_rows(prompt[b:b + n], s.prompt_logprobs)
            b += n
    return out_s, out_p


def _pack_tokens(tokens: torch.Tensor, scores: Optional[List[Optional[torch.Tensor]]]) -> torch.Tensor:
    """The token block ``[B, k + 1]`` int64, or with log-probabilities: one float64 vector of the
    tokens then the packed score blocks (one device -> host copy either way)."""
    if scores is None:
        return tokens
    return torch.cat([tokens.double().reshape(-1)] + [t.reshape(-1) for t in scores if t is not None])


class _HostCopy:
    """A device -> host copy in flight: pinned destination + event on CUDA, the tensor itself elsewhere."""

    def __init__(self, host: torch.Tensor, event: Optional[torch.cuda.Event]):
        self.host, self.event = host, event

    @classmethod
    def start(cls, src: torch.Tensor) -> "_HostCopy":
        if src.device.type != "cuda":
            return cls(src, None)
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        host.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(host, event)

    def wait(self) -> torch.Tensor:
        """The host tensor, once the copy is done (waits without holding the GIL)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host


class _CatchUpTimer:
    """The device time of a step's catch-up pass (deferred MTP entries): CUDA events around it, read
    once the pass is done; on a CPU the host time of the (synchronous) pass."""

    def __init__(self, device: torch.device):
        self.events: Optional[Tuple[torch.cuda.Event, torch.cuda.Event]] = None
        self.ms: Optional[float] = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> "_CatchUpTimer":
        if self.events is not None:
            self.events[1].record()
        else:
            self.ms = (time.perf_counter() - self._t0) * 1e3
        return self

    def elapsed_ms(self) -> float:
        """Milliseconds (waits for the pass's end on CUDA)."""
        if self.ms is None and self.events is not None:
            self.events[1].synchronize()
            self.ms = self.events[0].elapsed_time(self.events[1])
            self.events = None
        return self.ms


class PendingStep:
    """A step launched by :meth:`ModelRunner.launch`: its tokens and its drafts, each read once ready.

    ``output()`` waits for the tokens' copy only (the draft passes may still run) and returns the
    :class:`~mtpspec.step_io.StepOutput` with ``draft_token_ids = None``; ``drafts()`` waits for
    the drafts (``[]`` per sequence without a proposer and for partial prefill chunks).
    """

    def __init__(self, step: StepInput, inp: PreparedStep, shape: Tuple[int, int],
                 scores: Optional[List[Optional[torch.Tensor]]], token_copy: _HostCopy,
                 draft_copy: Optional[_HostCopy], fallbacks: int, comm: dict, t0: float,
                 catch_up: Optional[_CatchUpTimer] = None):
        # host facts only (no runner, no step tensors): a handle kept after the last step holds no model
        self._step, self._partial, self._shape = step, list(inp.host_partial), shape
        self._logprobs_meta = inp.logprobs_meta if scores is not None else None
        self._scores = None if scores is None else [None if t is None else t.shape for t in scores]
        self._token_copy, self._draft_copy = token_copy, draft_copy
        self._fallbacks, self._comm, self._t0 = fallbacks, comm, t0
        self._catch_up = catch_up
        self._out: Optional[StepOutput] = None
        self._drafts: Optional[List[List[int]]] = None

    def output(self) -> StepOutput:
        """The emitted tokens (placeholders cut) and log-probabilities; ``draft_token_ids`` is ``None``."""
        if self._out is not None:
            return self._out
        flat = self._token_copy.wait()
        k1 = self._shape[1]
        host_scores = None
        if self._scores is None:
            rows = flat.tolist()
        else:
            arr = flat.numpy()
            n = self._shape[0] * k1
            rows = arr[:n].reshape(self._shape).astype(np.int64).tolist()
            host_scores, off = [], n
            for shape in self._scores:
                if shape is None:
                    host_scores.append(None)
                    continue
                n = int(np.prod(shape))
                host_scores.append(arr[off:off + n].reshape(shape))
                off += n
        new_tokens = []
        for row in rows:
            n = next((i for i, t in enumerate(row) if t == PLACEHOLDER_TOKEN_ID), len(row))
            new_tokens.append(row[:n])
        out = StepOutput(new_tokens, None, self._fallbacks, self._comm, time.perf_counter() - self._t0)
        if host_scores is not None:
            out.logprobs, out.prompt_logprobs = _split_logprobs(self._step, self._logprobs_meta, new_tokens,
                                                                host_scores)
        self._out = out
        return out

    def catch_up_ms(self) -> Optional[float]:
        """Device ms of the step's catch-up pass (its deferred MTP entries), ``None`` without one;
        waits for the pass (read it with or after :meth:`drafts`, which waits for it anyway)."""
        return None if self._catch_up is None else self._catch_up.elapsed_ms()

    def drafts(self) -> List[List[int]]:
        """Per sequence, the ``k`` drafts for the next step."""
        if self._drafts is None:
            b = self._shape[0]
            drafts = [[] for _ in range(b)] if self._draft_copy is None else self._draft_copy.wait().tolist()
            for i in self._partial:
                drafts[i] = []
            self._drafts = drafts
        return self._drafts

"""MTP proposer: ``k`` greedy draft tokens per sequence from the MTP layers.

The MTP layer at position ``i`` takes the target's post-norm hidden state ``h_i`` and the
embedding of token ``i + 1`` and predicts token ``i + 2`` (DeepSeek-V3 technical report,
arXiv:2412.19437, section 2.2). After verification a sequence's rows ``0 .. a`` (``a`` = last
accepted row: the number of accepted drafts for a decode, ``q - 1`` for a prefill) hold valid
target hidden states, and its tokens at positions ``start + 1 .. start + a + 1`` are known (the
last one is the recovered / bonus / sampled token; for a prefill chunk that does not end its
prompt, chunked prefill, it is the next prompt token, so the chunk's first pass writes the MTP
KV entries a whole prefill would, and the drafts it yields are dropped by the runner).

1. First pass, over the step's whole flattened batch with the target's attention layout:
   ``input_ids`` shifted left by one inside each sequence with the new token written at row
   ``a``, the target's hidden states, ``spec_step_idx = 0``. This fills the MTP layers' KV cache
   at every position the target just computed; rows after ``a`` (rejected drafts) write
   entries that later passes overwrite before anything reads them. Row ``a``'s output gives
   draft 1. Running every row (instead of only the accepted ones) keeps the shapes fixed, so
   no device sync is needed to learn ``a``. In a step that runs its first pass eagerly (one with
   prefill chunks), a prefill's rows before its last only need their KV entries, which depend
   on the row alone: they go through the KV-only pass (``forward_kv_only``: no attention read,
   no MoE, no head) and the full pass runs on the decodes' rows and each prefill's last row
   (``split_prefill``; GLM-4.5-Air width: about a seventh of the full layer's work per row).
   With several MTP layers, every layer that a step uses (``j % num_mtp_layers``) gets the
   same first pass (same inputs, its own weights and KV cache; only layer 0's output is used),
   and every draft row that a later step reads is also written to the other used layers'
   caches, so each layer attends to the whole context. (GLM-4.5 and DeepSeek-V3 checkpoints
   have one MTP layer, where none of this runs.)
2. Steps ``j = 1 .. k - 1``: one row per sequence at position ``start + a + j``, the previous
   draft as input id, the previous step's output hidden state (post-norm) recycled, and
   ``spec_step_idx = j`` (the model uses layer ``j % num_mtp_layers``).

Drafts are greedy: ``get_top_tokens`` (vocab-parallel local argmax) when
``use_local_argmax_reduction`` is set, else ``compute_logits(...).argmax(-1)``. With
``draft_sampling="auto"`` every draft goes through ``get_sampled_tokens`` instead: rows with a
draft temperature ``T > 0`` (``PreparedStep.draft_temperature``) draw from the MTP layer's
``softmax(l / T)`` by vocab-parallel Gumbel-max (noise keyed by the request's seed key, the
drafted token's position and the global token id, stream
:data:`~mtpspec.sample.gumbel.STREAM_DRAFT`), the others take the argmax (the same ids as
``get_top_tokens``). The draws' ``log q(x)``, global log-sum-exp and this rank's local logits
stay in persistent buffers (indexed by batch index and draft), written there directly by the
LM-head matmul and the Gumbel kernels (no copies), which the next step's verifier reads before
this step's drafting overwrites them (:class:`SampledDraftState`). Per-row inputs come from
persistent buffers too (the noise row hashes are computed inside the kernel), so the draft steps
stay CUDA-graph capturable.

A step that drafts nothing (k = 0, adaptive speculation length) still owes the MTP layers the
cache entries of the positions the target computed: :meth:`MTPProposer.write_kv_only` runs phase
1's inputs through the draft model's ``forward_kv_only`` (cache writes only, no outputs).

Phase 1 is the proposer's *prefill*, phase 2 its *multi-step decode*; :meth:`MTPProposer.propose`
brackets them with the lifecycle hooks of :class:`~mtpspec.spec_decode.proposer.Proposer`, which
drive MTP index sharing (sparse-attention models, ``index_share_for_mtp_iteration``:
:mod:`mtpspec.spec_decode.index_share`) and are no-ops otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from mtpspec.config import SpeculativeConfig
from mtpspec.layers.attention import AttentionMetadata
from mtpspec.models.interfaces import supports_local_argmax
from mtpspec.sample.gumbel import STREAM_DRAFT, GumbelPick, NoiseRows
from mtpspec.spec_decode.draft_forward import DraftForward, EagerDraftForward
from mtpspec.spec_decode.index_share import IndexShareState, attach_index_share
from mtpspec.spec_decode.proposer import GraphUnits, Proposer
from mtpspec.step_io import PreparedStep, host_to_device


#: Fewest prefill rows a first pass moves to a KV-only pass (:meth:`MTPProposer._split_prefill_rows`).
PREFILL_KV_ONLY_MIN_ROWS = 16


class LocalArgmaxUnsupportedError(TypeError):
    """``use_local_argmax_reduction`` was requested from a model without ``get_top_tokens``."""


@dataclass
class SampledDraftState:
    """Persistent buffers of sampled drafts (``R = max_num_seqs`` rows, ``k`` drafts).

    Inputs (written by :meth:`MTPProposer.propose` before drafting): ``temperature [R]`` float32
    (0: greedy), ``seed_keys [R]`` int64, ``base [R]`` int64 (draft ``j`` decides position
    ``base + 2 + j``). Outputs: ``local_logits [k, R, per_rank]`` (this rank's shard, model dtype;
    draft-major, so draft ``j``'s rows ``local_logits[j, :n]`` are a contiguous matrix the LM-head
    matmul writes into), ``log_q [R, k]`` and ``lse [R, k]`` float32 (written by the Gumbel kernel).
    """

    temperature: torch.Tensor
    seed_keys: torch.Tensor
    base: torch.Tensor
    local_logits: torch.Tensor
    log_q: torch.Tensor
    lse: torch.Tensor


class MTPProposer(Proposer):
    """Drafts ``k`` tokens per sequence with an MTP model (``SpeculativeConfig.method == "mtp"``).

    Args:
        model: the MTP model: ``forward(input_ids, positions, previous_hidden_states,
            spec_step_idx)``, ``compute_logits(hidden, spec_step_idx)`` and, for local argmax,
            ``get_top_tokens(hidden, spec_step_idx)``.
        k: draft tokens per step (>= 1).
        use_local_argmax_reduction: draft with ``get_top_tokens``.
        block_size: KV block size.
        max_position: the model's positions must stay below this.
        index_share: share the MTP indexers' selection across the round's draft steps
            (``index_share_for_mtp_iteration``, :mod:`mtpspec.spec_decode.index_share`).
        max_num_seqs: requests per step (the sharing buffers' rows).
        draft_sampling: ``"greedy"`` or ``"auto"`` (sampled drafts, see the module docstring).

    Raises:
        LocalArgmaxUnsupportedError: the flag is set and the model does not implement
            :class:`~mtpspec.models.interfaces.SupportsLocalArgmax` (message names its class).
        ValueError: ``k < 1``; ``index_share`` with a draft model without an indexer.
    """

    def __init__(self, model: nn.Module, k: int, use_local_argmax_reduction: bool, block_size: int,
                 max_position: int, index_share: bool = False, max_num_seqs: int = 256,
                 draft_sampling: str = "greedy"):
        if use_local_argmax_reduction and not supports_local_argmax(model):
            raise LocalArgmaxUnsupportedError(
                f"use_local_argmax_reduction=True but the draft model {type(model).__name__} does not implement "
                "SupportsLocalArgmax (get_top_tokens); set use_local_argmax_reduction=False")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.model = model
        self.k = k
        self.use_local_argmax = use_local_argmax_reduction
        self.block_size = block_size
        self.max_position = max_position
        self.index_share: List[IndexShareState] = (attach_index_share(model, k, max_num_seqs) if index_share
                                                   else [])
        self.sampled: Optional[SampledDraftState] = None
        if draft_sampling == "auto":
            if not all(hasattr(model, m) for m in ("get_sampled_tokens", "local_vocab_range", "get_layer")):
                raise TypeError(f"draft_sampling='auto' but the draft model {type(model).__name__} has no "
                                "get_sampled_tokens / local_vocab_range; use draft_sampling='greedy'")
            head = model.get_layer(0).shared_head.head
            dev, r = head.weight.device, max_num_seqs
            self.sampled = SampledDraftState(
                torch.zeros(r, device=dev), torch.zeros(r, dtype=torch.int64, device=dev),
                torch.zeros(r, dtype=torch.int64, device=dev),
                torch.zeros(k, r, head.weight.shape[0], dtype=head.weight.dtype, device=dev),
                torch.zeros(r, k, device=dev), torch.zeros(r, k, device=dev))
        elif draft_sampling != "greedy":
            raise ValueError(f"draft_sampling must be 'greedy' or 'auto', got {draft_sampling!r}")

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, draft_model: nn.Module, *, block_size: int,
                    max_position: int, max_num_seqs: int = 256) -> "MTPProposer":
        """``k = spec.num_speculative_tokens``, ``spec.use_local_argmax_reduction`` and
        ``spec.index_share_for_mtp_iteration`` (``None``: off); raises as the constructor."""
        return cls(draft_model, spec.num_speculative_tokens, spec.use_local_argmax_reduction, block_size,
                   max_position, bool(spec.index_share_for_mtp_iteration), max_num_seqs, spec.draft_sampling)

    # ---------------------------------------------------------------- lifecycle hooks (index sharing)
    def _set_share_mode(self, mode: str) -> None:
        for state in self.index_share:
            state.set_mode(mode)

    def on_prefill_begin(self, attn_metadata: AttentionMetadata) -> None:
        """Sharing with ``k > 1``: the MTP indexers record each request's anchor selection."""
        if self.k > 1:
            self._set_share_mode("record")

    def on_prefill_end(self, attn_metadata: AttentionMetadata) -> None:
        self._set_share_mode("off")

    def on_multi_step_decode_begin(self, num_seqs: int, num_steps: int) -> None:
        """Sharing: the draft steps reuse the recorded selection (no indexer scoring)."""
        if num_steps > 0:
            self._set_share_mode("reuse")

    def on_multi_step_decode_end(self, num_seqs: int, num_steps: int) -> None:
        self._set_share_mode("off")

    def graph_units(self) -> GraphUnits:
        """First pass: every used MTP layer. Steps: ``(j, True)`` for ``j = 1 .. k - 1``, plus the
        cache-filling ``(layer, False)`` calls when several layers are used and ``k > 2``.
        Draft function: :meth:`_top`."""
        used = self._used_layers()
        steps = [(j, True) for j in range(1, self.k)]
        steps += [(layer, False) for layer in used] if self.k > 2 and len(used) > 1 else []
        return GraphUnits(tuple(used), tuple(steps), self._top)

    def _used_layers(self) -> list:
        """MTP layer indices the ``k`` steps use: ``0 .. min(k, num_mtp_layers) - 1``."""
        return list(range(min(self.k, int(getattr(self.model, "num_mtp_layers", 1)))))

    def _top(self, hidden: torch.Tensor, step: int) -> torch.Tensor:
        if self.sampled is not None:
            return self._sample_top(hidden, step)
        if self.use_local_argmax:
            return self.model.get_top_tokens(hidden, spec_step_idx=step)
        return self.model.compute_logits(hidden, spec_step_idx=step).argmax(dim=-1)

    def _sample_top(self, hidden: torch.Tensor, step: int) -> torch.Tensor:
        """Draft ``step`` of the first ``n`` rows: Gumbel-max draw (argmax where ``T == 0``);
        records ``log q``, the log-sum-exp and the local logits in :attr:`sampled`, written there
        directly (the matmul's output, the kernel's stores; the row hashes are computed in the kernel)."""
        st, n = self.sampled, hidden.shape[0]
        rows = NoiseRows(st.seed_keys[:n], st.base[:n], 2 + step, STREAM_DRAFT)
        out = GumbelPick(torch.empty(n, dtype=torch.int64, device=hidden.device), st.log_q[:n, step], st.lse[:n, step])
        pick, _ = self.model.get_sampled_tokens(hidden, st.temperature[:n], rows, spec_step_idx=step, out=out,
                                                logits_out=st.local_logits[step, :n])
        return pick.token_ids

    def _steps_metadata(self, inp: PreparedStep, base: torch.Tensor, k: int,
                        host_base: Optional[list]) -> List[Tuple[AttentionMetadata, torch.Tensor]]:
        """``(metadata, clamped positions [B])`` of draft steps ``1 .. k - 1``: each sequence's one
        row at position ``base + step``; built for every step at once (one set of small ops per
        draft round instead of one per step: host time, which bounds a step at batch 1)."""
        b, bs = base.shape[0], self.block_size
        if k <= 1:
            return []
        pos = base.unsqueeze(0) + torch.arange(1, k, device=base.device).unsqueeze(1)  # [k - 1, B]
        blocks = torch.gather(inp.block_tables[:b], 1, (pos // bs).t()).t()
        slots = blocks.long() * bs + pos % bs
        seq_lens = (pos + 1).to(torch.int32)
        clamped = pos.clamp(max=self.max_position - 1)
        qsl = torch.arange(b + 1, device=base.device, dtype=torch.int32)
        upper = max(inp.attn_metadata.seq_lens_list) + self.k  # host bound, no sync
        out = []
        for i in range(k - 1):
            host = [p + i + 2 for p in host_base] if host_base is not None else []
            out.append((AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens[i], slot_mapping=slots[i],
                                          block_tables=inp.block_tables, num_seqs=b, max_query_len=1,
                                          max_seq_len=upper, query_lens=[1] * b, seq_lens_list=host), clamped[i]))
        return out

    @staticmethod
    def _first_pass_ids(inp: PreparedStep, new_token_ids: torch.Tensor, last_rows: torch.Tensor) -> torch.Tensor:
        """The first pass's input ids ``[T]``: ``input_ids`` shifted left by one, each sequence's new
        token written at its last valid row ``last_rows [B]``."""
        ids = torch.cat([inp.input_ids[1:], inp.input_ids.new_zeros(1)])
        return ids.index_copy(0, last_rows, new_token_ids)

    @torch.inference_mode()
    def write_kv_only(self, inp: PreparedStep, target_hidden: torch.Tensor, new_token_ids: torch.Tensor,
                      last_row_offsets: Optional[torch.Tensor], fwd: Optional[DraftForward] = None) -> None:
        """The k = 0 counterpart of :meth:`propose`'s first pass: fill the MTP layers' KV caches at
        every position the target computed in this step, without drafting.

        Same inputs as the first pass (input ids shifted by one with each sequence's new token at
        its last valid row, the target's positions, hidden states and attention layout), run through
        ``fwd.mtp_kv_only`` for every MTP layer :meth:`propose` would use at this proposer's ``k``
        (:meth:`_used_layers`): the cache entries (attention and DSA indexer keys) are the ones the
        first pass writes. No indexer selection runs: MTP index sharing is set ``"off"`` and no
        anchor is recorded. No host sync.

        Args:
            inp, target_hidden, new_token_ids, last_row_offsets, fwd: as :meth:`propose`;
                ``last_row_offsets`` ``None``: every sequence has one row, so the first pass's ids
                are ``new_token_ids`` themselves (a plain-decoding step; no shift, no scatter).
        """
        if last_row_offsets is None:
            ids = new_token_ids
        else:
            ids = self._first_pass_ids(inp, new_token_ids, inp.seg_starts + last_row_offsets)
        self.write_kv_rows(ids, inp.positions, target_hidden, inp.attn_metadata, fwd)

    @torch.inference_mode()
    def write_kv_rows(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                      meta: AttentionMetadata, fwd: Optional[DraftForward] = None) -> None:
        """The MTP KV entries of arbitrary rows: row ``i`` is position ``positions[i]`` with the
        target's hidden state ``hidden[i]`` and its next token ``ids[i]``, written at
        ``meta.slot_mapping[i]``, in every layer :meth:`propose` uses (``fwd.mtp_kv_only``; default
        eager). :meth:`write_kv_only`'s pass, and the catch-up of deferred entries
        (:mod:`mtpspec.spec_decode.deferred_mtp`). MTP index sharing is set ``"off"``. No host sync.

        Args:
            ids, positions: ``[T]`` int64; hidden: ``[T, H]``; meta: the rows' layout (slots,
                block tables); ``None``: computed, nothing written (the memory profile's pass,
                :meth:`~mtpspec.engine.model_runner.ModelRunner.profile_and_count_blocks`).
        """
        fwd = fwd if fwd is not None else EagerDraftForward(self.model)
        self._set_share_mode("off")
        for layer in self._used_layers():
            fwd.mtp_kv_only(ids, positions, hidden, meta, layer)

    @torch.inference_mode()
    def _split_prefill_rows(self, inp: PreparedStep) -> Optional[tuple]:
        """The first pass on fewer rows (module docstring, phase 1): every prefill row but each
        sequence's last needs only its MTP KV entries, whose values depend on the row alone.
        Returns ``(keep, kv_rows, kv_meta, meta, base)``: the rows the full pass keeps (every
        decode row, each prefill's last row) and its layout ``meta`` (the same sequences, each
        prefill with one query row), the KV-only rows and their layout, and ``base [B]`` with
        ``base + last_row_offsets`` = each sequence's last row among the kept ones. ``None`` when
        fewer than :data:`PREFILL_KV_ONLY_MIN_ROWS` rows would move (not worth the extra launches)."""
        q = np.asarray(inp.host_query_lens, dtype=np.int64)
        nd, b = inp.num_decodes, len(inp.host_query_lens)
        moved = q[nd:] - 1
        if int(moved.sum()) < PREFILL_KV_ONLY_MIN_ROWS:
            return None
        seg = np.concatenate([[0], np.cumsum(q)])
        keep = np.concatenate([np.arange(seg[nd]), seg[nd + 1:] - 1])
        kv_seqs = [i for i in range(nd, b) if q[i] > 1]
        kv = np.concatenate([np.arange(seg[i], seg[i + 1] - 1) for i in kv_seqs])
        q_keep = np.concatenate([q[:nd], np.ones(b - nd, dtype=np.int64)])
        seg_keep = np.concatenate([[0], np.cumsum(q_keep)])
        base = seg_keep[:-1].copy()
        base[nd:] -= moved  # a prefill's last_row_offset is q - 1: its kept row is its segment's first
        starts = np.asarray(inp.host_start_positions, dtype=np.int64)
        q_kv = q[kv_seqs] - 1
        kv_lens = (starts[kv_seqs] + q_kv).tolist()
        dev = inp.input_ids.device
        keep_d, kv_d, kv_seqs_d, base_d = host_to_device([keep, kv, kv_seqs, base], torch.int64, dev)
        qsl_keep, qsl_kv, kv_lens_d = host_to_device([seg_keep, np.concatenate([[0], np.cumsum(q_kv)]), kv_lens],
                                                     torch.int32, dev)
        m = inp.attn_metadata
        meta = AttentionMetadata(query_start_loc=qsl_keep, seq_lens=m.seq_lens,
                                 slot_mapping=m.slot_mapping.index_select(0, keep_d), block_tables=m.block_tables,
                                 num_seqs=m.num_seqs, max_query_len=int(q_keep.max()), max_seq_len=m.max_seq_len,
                                 query_lens=q_keep.tolist(), seq_lens_list=list(m.seq_lens_list))
        kv_meta = AttentionMetadata(query_start_loc=qsl_kv, seq_lens=kv_lens_d,
                                    slot_mapping=m.slot_mapping.index_select(0, kv_d),
                                    block_tables=m.block_tables.index_select(0, kv_seqs_d), num_seqs=len(kv_seqs),
                                    max_query_len=int(q_kv.max()), max_seq_len=max(kv_lens), query_lens=q_kv.tolist(),
                                    seq_lens_list=kv_lens)
        return keep_d, kv_d, kv_meta, meta, base_d

    def propose(self, inp: PreparedStep, target_hidden: torch.Tensor, new_token_ids: torch.Tensor,
                last_row_offsets: torch.Tensor, host_last_row_offsets: Optional[list] = None,
                fwd: Optional[DraftForward] = None, k: Optional[int] = None,
                split_prefill: bool = False) -> torch.Tensor:
        """Draft ``k`` tokens per sequence (the module docstring's phases 1 and 2).

        Args:
            inp: the step's prepared inputs (target layout, block tables, positions).
            target_hidden: ``[T, H]`` the target's post-norm hidden states of this step.
            new_token_ids: ``[B]`` int64, each sequence's newest token (sampled / recovered / bonus;
                the next prompt token for a partial prefill chunk).
            last_row_offsets: ``[B]`` int64, ``a`` per sequence (row of the last valid hidden state
                inside its segment).
            host_last_row_offsets: the same as a python list when it is free to have (CPU);
                gives the attention layer exact host-side lengths. ``None`` on GPU.
            fwd: how to call the model (a :class:`~mtpspec.spec_decode.draft_forward.DraftForward`;
                default :class:`~mtpspec.spec_decode.draft_forward.EagerDraftForward`).
            k: drafts this step, ``1 .. self.k`` (adaptive speculation length); ``None``: ``self.k``.
                The first pass covers the layers of ``self.k`` (every layer stays filled).
            split_prefill: the first pass may run eagerly on fewer rows (``fwd`` runs it on the
                step's own layout, not through graph buffers): prefill rows but each sequence's
                last get their KV entries from a KV-only pass (:meth:`_split_prefill_rows`).

        Returns:
            ``[B, k]`` int64 draft tokens.

        Raises:
            ValueError: ``k`` outside ``[1, self.k]``.
        """
        k = self.k if k is None else k
        if not 1 <= k <= self.k:
            raise ValueError(f"propose: k must be in [1, {self.k}], got {k}")
        fwd = fwd if fwd is not None else EagerDraftForward(self.model)
        b = new_token_ids.shape[0]
        last_rows = inp.seg_starts + last_row_offsets
        ids = self._first_pass_ids(inp, new_token_ids, last_rows)
        positions, first_hidden, meta = inp.positions, target_hidden, inp.attn_metadata
        split = self._split_prefill_rows(inp) if split_prefill and inp.num_prefills else None
        if split is not None:
            keep, kv, kv_meta, meta, row_base = split
            self.write_kv_rows(ids.index_select(0, kv), positions.index_select(0, kv),
                               first_hidden.index_select(0, kv), kv_meta, fwd)
            ids, positions, first_hidden = (x.index_select(0, keep) for x in (ids, positions, first_hidden))
            last_rows = row_base + last_row_offsets
        used = self._used_layers()
        for state in self.index_share:  # anchor: each request's last accepted row of the first pass
            state.set_anchor_rows(last_rows)
        base = inp.start_positions + last_row_offsets
        if self.sampled is not None:  # the sampled draft's inputs, before the first pass draws
            st = self.sampled
            if inp.draft_temperature is None:
                st.temperature[:b].zero_()
            else:
                st.temperature[:b].copy_(inp.draft_temperature)
                st.seed_keys[:b].copy_(inp.draft_seed_keys)
            st.base[:b].copy_(base)
        self.on_prefill_begin(meta)
        # layer 0's first pass, each sequence's last row and its draft in one call (one graph)
        hidden, tok = fwd.mtp_first_top(ids, positions, first_hidden, meta, 0, last_rows, self._top)
        # Layers other than 0 that later steps use get the same first pass, so their KV
        # caches hold the accepted context too (outputs unused).
        for layer in used[1:]:
            fwd.mtp_first(ids, positions, first_hidden, meta, layer)
        self.on_prefill_end(meta)
        drafts = [tok]
        self.on_multi_step_decode_begin(b, k - 1)
        host_base = None
        if host_last_row_offsets is not None:
            host_base = [s + a for s, a in zip(inp.host_start_positions, host_last_row_offsets)]
        for step, (meta, clamped) in enumerate(self._steps_metadata(inp, base, k, host_base), start=1):
            out, tok = fwd.mtp_step(drafts[-1], clamped, hidden, meta, step, self._top)
            if step < k - 1:  # later steps on other layers read this row from their caches
                for layer in used:
                    if layer != step % len(used):
                        fwd.mtp_step(drafts[-1], clamped, hidden, meta, layer, None)
            hidden = out
            drafts.append(tok)
        self.on_multi_step_decode_end(b, k - 1)
        return torch.stack(drafts, dim=1)[:b]

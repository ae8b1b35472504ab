"""How the runner calls the models: eagerly, or for pure-decode steps through padded static
buffers replayed as CUDA graphs.

Graph units (one per padded batch size ``Bp`` from :func:`capture_sizes`, which covers every
batch up to ``max_num_seqs``, and per verify width ``v`` of ``ks``: ``k`` alone, or ``0 .. k``
under adaptive speculation length):

* ``verify``: target forward over ``Bp x (1 + v)`` rows + ``compute_logits`` of every row
  (``v = 0``: the plain decode step); with deferred MTP entries (:attr:`GraphedForward.hidden_sink`)
  also the rows' hidden states into their cache;
* ``firsttop`` (the first used MTP layer): the MTP first pass over the same rows, then each
  sequence's last valid row and its draft token (the proposer's ``draft_fn``), so the first draft's
  LM head and argmax run inside the graph; ``first`` (each further used layer): the first pass alone;
* ``kvonly`` (per used MTP layer; adaptive only): the MTP layers' KV-cache writes of the same
  rows, for steps that propose no drafts;
* ``step`` (per ``spec_step_idx``): one MTP row per sequence, + the greedy draft when wanted.

The proposer names its units (:meth:`~mtpspec.spec_decode.proposer.Proposer.graph_units`) and
capture brackets them with its lifecycle hooks, as :meth:`~mtpspec.spec_decode.proposer.Proposer.propose`
does at run time. The draft-model calls implement the proposer's
:class:`~mtpspec.spec_decode.draft_forward.DraftForward`.

Prefill units (one per padded row count ``Tp`` of :func:`prefill_capture_sizes`): a step of one
sequence with ``T <= Tp`` new rows that is not a pure decode (a prompt, a prefix-cache hit's
remainder, a prompt's last chunk) and samples at most one row runs ``pverify`` (target forward
over ``Tp`` rows + ``compute_logits`` of the sampled row) and ``pfirst`` (the MTP first pass over
the same rows); its draft steps use the ``Bp = 1`` step units. Eagerly such a step is bound by
the host (an H200 profile of a 78-row step of a 16-layer model: about 1,400 launches, 30 ms of
host time for 14 ms of kernels), which is what a prefix-cache hit's TTFT is made of (issue 17).

Padding (batch ``B < Bp``): padded sequences get ``q_len = 0`` (``query_start_loc`` repeats its
last value) and ``seq_len = 0``; padded rows get slot ``-1``, position 0, token 0 and a zero
hidden state (zero rows stay finite through RMSNorm). Callers slice every output to the real
rows before sampling or emission, so padding never reaches them. The captured metadata carries
no host lists: a graph-safe attention backend reads only the device tensors.

``graph_mode``: ``"off"`` (always eager), ``"cuda"`` (capture at start-up; a failed capture is
logged once and every pure-decode step then counts as an eager fall-back), ``"static"`` (the
padded static-buffer path without capture, with host lists; what the CPU tests exercise).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from mtpspec.distributed import get_tensor_model_parallel_world_size
from mtpspec.layers.attention import AttentionMetadata, set_forward_context
from mtpspec.spec_decode.draft_forward import DraftTokenFn, EagerDraftForward
from mtpspec.spec_decode.proposer import GraphUnits, Proposer
from mtpspec.timing import median_call_ms

if TYPE_CHECKING:
    from mtpspec.spec_decode.deferred_mtp import MTPHiddenStateCache

logger = logging.getLogger(__name__)


#: Candidate padded row counts of the single-sequence prefill units (fine steps: a unit reads all the
#: weights, and at up to 256 rows its GEMMs are still weight-read bound, but padding costs MoE and
#: attention work).
PREFILL_SIZES = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def prefill_capture_sizes(max_num_batched_tokens: int, max_model_len: int) -> List[int]:
    """The :data:`PREFILL_SIZES` a step can use: at most ``max_num_batched_tokens`` and ``max_model_len``."""
    return [s for s in PREFILL_SIZES if s <= min(max_num_batched_tokens, max_model_len)]


def capture_sizes(max_num_seqs: int) -> List[int]:
    """1, 2, 4, 8, then every multiple of 8 below ``max_num_seqs``, then ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class EagerForward(EagerDraftForward):
    """Calls the models directly (prefills, mixed steps, CPU); the draft calls are inherited."""

    def __init__(self, target: torch.nn.Module, mtp: Optional[torch.nn.Module]):
        super().__init__(mtp)
        self.target_model = target
        self.num_eager_fallbacks = 0
        #: this step's verify wrote its rows' hidden states into :attr:`GraphedForward.hidden_sink`
        self.wrote_hidden = False

    def begin_step(self, pure_decode: bool, num_seqs: int, block_tables: torch.Tensor, num_rows: int = 0,
                   num_sample_rows: int = 0, k: Optional[int] = None) -> None:
        """Called once per step before any forward (``num_rows``: the step's new rows; ``num_sample_rows``:
        rows whose logits it samples; ``k``: drafts per decode, ``None``: the configured ``k``)."""

    def eager_first_pass(self) -> bool:
        """Whether this step's MTP first pass runs eagerly on the step's own layout (so the proposer
        may run it on fewer rows: :meth:`~mtpspec.spec_decode.mtp_proposer.MTPProposer.propose`)."""
        return True

    def verify(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
               sample_rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Target hidden states ``[T, H]`` and logits of ``sample_rows`` ``[R, V]``."""
        with set_forward_context(meta):
            hidden = self.target_model(ids, pos)
        return hidden, self.target_model.compute_logits(hidden.index_select(0, sample_rows))


def _logits_buffer(target: torch.nn.Module, rows: int, device: torch.device) -> Optional[torch.Tensor]:
    """``[rows, tp * per_rank vocab]`` (the padded vocab) in the LM head's dtype for the verify units'
    logits (``None`` for a target without ``lm_head``)."""
    head = getattr(target, "lm_head", None)
    if head is None:
        return None
    width = get_tensor_model_parallel_world_size() * head.num_embeddings_per_partition
    return torch.empty(rows, width, dtype=head.weight.dtype, device=device)


class GraphedForward(EagerForward):
    """Pure-decode steps through static padded buffers (captured as CUDA graphs in ``"cuda"`` mode).

    Args:
        target, mtp: the models.
        k: draft tokens (rows per sequence in verify = ``1 + k``).
        max_num_seqs: largest batch; :func:`capture_sizes` of it are prepared.
        max_blocks_per_seq: block-table width.
        hidden_size: ``H``.
        dtype, device: of the hidden states.
        mode: ``"cuda"`` or ``"static"`` (see the module docstring).
        max_seq_len: upper bound of any sequence length (host field of the captured metadata).
        prefill_sizes: padded row counts of the single-sequence prefill units (``[]``: none;
            see the module docstring and :func:`prefill_capture_sizes`).
        ks: verify widths (drafts per decode) to capture, each in ``0 .. k`` (default ``(k,)``;
            adaptive speculation length: ``0 .. k``, with the ``kvonly`` units).
        kv_only_units: capture the ``kvonly`` units with ``ks`` (``False``: adaptive speculation
            that defers k = 0 steps' MTP entries; a KV-only call then runs eagerly).
    """

    def __init__(self, target: torch.nn.Module, mtp: Optional[torch.nn.Module], k: int, max_num_seqs: int,
                 max_blocks_per_seq: int, hidden_size: int, dtype: torch.dtype, device: torch.device, mode: str,
                 max_seq_len: int, prefill_sizes: Sequence[int] = (), ks: Optional[Sequence[int]] = None,
                 kv_only_units: bool = True):
        super().__init__(target, mtp)
        if mode not in ("cuda", "static"):
            raise ValueError(f"graph mode must be 'cuda' or 'static', got {mode!r}")
        self.k, self.mode, self.max_seq_len = k, mode, max_seq_len
        self.ks = tuple(sorted(set(ks))) if ks is not None else (k,)
        if not all(0 <= v <= k for v in self.ks):
            raise ValueError(f"verify widths {self.ks} must lie in [0, k={k}]")
        self.kv_only = ks is not None and mtp is not None and kv_only_units  # capture the kvonly units too
        self.step_k = k  # drafts per decode of the current step
        self.sizes = capture_sizes(max_num_seqs)
        self.prefill_sizes = sorted(prefill_sizes)
        bmax = max_num_seqs
        tmax = max([max_num_seqs * (1 + k)] + self.prefill_sizes)
        z = lambda *s, dt=torch.int64: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
        self.ids, self.pos, self.slots = z(tmax), z(tmax), z(tmax)
        self.qsl, self.seq_lens = z(bmax + 1, dt=torch.int32), z(bmax, dt=torch.int32)
        self.block_tables = torch.full((bmax, max_blocks_per_seq), -1, dtype=torch.int32, device=device)
        self.mtp_ids, self.hidden_in = z(tmax), torch.zeros(tmax, hidden_size, dtype=dtype, device=device)
        self.s_ids, self.s_pos, self.s_slots = z(bmax), z(bmax), z(bmax)
        self.s_qsl, self.s_seq_lens = z(bmax + 1, dt=torch.int32), z(bmax, dt=torch.int32)
        self.s_hidden = torch.zeros(bmax, hidden_size, dtype=dtype, device=device)
        self.p_sample = z(1)  # the prefill units' sampled row
        # the verify units' logits, shared by every batch size and width: kept per unit in the
        # graph pool they summed to ~13 GB of an adaptive Air engine's graphs (H100, 2026-12-05)
        self.logits_out = _logits_buffer(target, max_num_seqs * (1 + k), device)
        self.first_rows = z(bmax)  # each sequence's last valid row, for the first pass's draft (firsttop)
        self.graphs: Dict[tuple, Tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.pool = None
        self.capture_failed: Optional[str] = None
        self._capturing: Optional[tuple] = None  # the unit being captured
        self.active: Optional[int] = None  # padded batch size of the current step, or None (eager)
        self.prefill_rows: Optional[int] = None  # Tp of the current single-sequence prefill step, or None
        self.num_prefill_graph_steps = 0
        self.mixed = False  # the current step has prefill chunks (its verify and first pass run eagerly)
        self.mixed_tables: Optional[torch.Tensor] = None  # the block tables such a step's draft steps set
        self.num_mixed_graph_steps = 0  # such steps whose draft steps ran through the step units
        self.num_seqs = 0
        self.num_graph_steps = 0  # steps that ran through the static buffers / graphs
        # adaptive speculation deferring MTP entries (deferred_mtp.MTPHiddenStateCache): the verify units
        # write their rows' hidden states there too, set before capture (a k = 0 step then launches nothing
        # for them: ~10 us of host a step eagerly, on a host-bound step)
        self.hidden_sink: Optional["MTPHiddenStateCache"] = None
        self._warned = False

    # ---------------------------------------------------------------- metadata over the buffers
    def _meta(self, bp: int, host: bool, step: bool, rows: Optional[int] = None) -> AttentionMetadata:
        """Metadata over the static buffers: ``Bp`` sequences of ``1 + v`` rows (``v`` = this
        step's :attr:`step_k`; ``rows``: one sequence of ``rows`` rows, the prefill units), or
        ``Bp`` single rows (``step``)."""
        max_q = 1 if step else (rows or 1 + self.step_k)
        rows = bp if step else (rows or bp * (1 + self.step_k))
        qsl, sl, slots = (self.s_qsl, self.s_seq_lens, self.s_slots) if step else (self.qsl, self.seq_lens, self.slots)
        q_lens: List[int] = []
        s_lens: List[int] = []
        if host:  # static mode: exact host lists (free on CPU); never inside a captured graph
            q_host = qsl[:bp + 1].tolist()
            q_lens = [b - a for a, b in zip(q_host, q_host[1:])]
            s_lens = sl[:bp].tolist()
        return AttentionMetadata(query_start_loc=qsl[:bp + 1], seq_lens=sl[:bp], slot_mapping=slots[:rows],
                                 block_tables=self.block_tables[:bp], num_seqs=bp,
                                 max_query_len=max_q, max_seq_len=self.max_seq_len,
                                 query_lens=q_lens, seq_lens_list=s_lens)

    def padded(self, b: int) -> Optional[int]:
        """The graph batch size ``b`` sequences run at (``None``: above every captured size)."""
        return next((s for s in self.sizes if s >= b), None)

    # ---------------------------------------------------------------- per step
    def begin_step(self, pure_decode: bool, num_seqs: int, block_tables: torch.Tensor, num_rows: int = 0,
                   num_sample_rows: int = 0, k: Optional[int] = None) -> None:
        self.active = self.prefill_rows = self.mixed_tables = None
        self.wrote_hidden = False
        self.mixed = not pure_decode
        self.step_k = self.k if k is None else k
        if not pure_decode:
            tp = next((s for s in self.prefill_sizes if s >= num_rows), None)
            if num_seqs == 1 and num_sample_rows <= 1 and tp is not None and self.capture_failed is None:
                self.prefill_rows, self.num_seqs = tp, 1
                self.num_prefill_graph_steps += 1
                self._set_tables(block_tables, 1, 1)
            return
        bp = self.padded(num_seqs)
        if bp is None or self.capture_failed is not None or self.step_k not in self.ks:
            self.num_eager_fallbacks += 1
            if not self._warned:
                self._warned = True
                why = self.capture_failed or (f"batch of {num_seqs} exceeds the largest graph ({self.sizes[-1]})"
                                              if bp is None else f"no graph verifies {self.step_k} drafts")
                logger.warning("decode step runs eagerly instead of through a CUDA graph: %s (logged once; "
                               "every such step is counted in num_eager_fallbacks)", why)
            return
        self.active, self.num_seqs = bp, num_seqs
        self.num_graph_steps += 1
        self._set_tables(block_tables, num_seqs, bp)

    def eager_first_pass(self) -> bool:
        return self.active is None and self.prefill_rows is None

    def _set_tables(self, block_tables: torch.Tensor, b: int, bp: int) -> None:
        w = block_tables.shape[1]
        if w < self.block_tables.shape[1]:
            self.block_tables[:b, w:].fill_(-1)
        self.block_tables[:b, :w].copy_(block_tables[:b])
        if bp > b:
            self.block_tables[b:bp].fill_(-1)

    def _run(self, key: tuple, fn: Callable[[AttentionMetadata], tuple], bp: int, step: bool,
             rows: Optional[int] = None) -> tuple:
        if self.mode == "static":
            return fn(self._meta(bp, host=True, step=step, rows=rows))
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs

    def _fill_rows(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, rows: int, bp: int) -> None:
        """The target layout (``t`` rows of ``self.num_seqs`` sequences) into the row buffers,
        padded to ``rows`` rows and ``bp`` sequences (the module docstring's padding)."""
        b, t = self.num_seqs, ids.shape[0]
        self.ids[:t].copy_(ids)
        self.pos[:t].copy_(pos)
        self.slots[:t].copy_(meta.slot_mapping[:t])
        if rows > t:  # padding rows (each skipped call is host time: it bounds a step at batch 1)
            self.ids[t:rows].zero_()
            self.pos[t:rows].zero_()
            self.slots[t:rows].fill_(-1)
        self.qsl[:b + 1].copy_(meta.query_start_loc[:b + 1])
        self.seq_lens[:b].copy_(meta.seq_lens[:b])
        if bp > b:
            self.qsl[b + 1:bp + 1].fill_(t)
            self.seq_lens[b:bp].zero_()

    def verify(self, ids, pos, meta, sample_rows):
        tp = self.prefill_rows
        if tp is not None:  # one sequence's prefill rows, padded to Tp
            t, r = ids.shape[0], sample_rows.shape[0]
            self._fill_rows(ids, pos, meta, tp, 1)
            if r:
                self.p_sample.copy_(sample_rows)
            hidden, logits = self._run(("pverify", tp), self._pverify_fn(tp), 1, step=False, rows=tp)
            return hidden[:t], logits[:r]
        bp = self.active
        if bp is None:
            return super().verify(ids, pos, meta, sample_rows)
        t, v = ids.shape[0], self.step_k
        self._fill_rows(ids, pos, meta, bp * (1 + v), bp)
        hidden, logits = self._run(("verify", bp, v), self._verify_fn(bp, v), bp, step=False)
        self.wrote_hidden = self.hidden_sink is not None
        return hidden[:t], logits[:t]  # decode: every row is a sample row

    def _pverify_fn(self, tp: int) -> Callable[[AttentionMetadata], tuple]:
        def fn(meta: AttentionMetadata) -> tuple:
            with set_forward_context(meta):
                hidden = self.target_model(self.ids[:tp], self.pos[:tp])
            return hidden, self.target_model.compute_logits(hidden.index_select(0, self.p_sample))
        return fn

    def _verify_fn(self, bp: int, v: int) -> Callable[[AttentionMetadata], tuple]:
        rows = bp * (1 + v)

        def fn(meta: AttentionMetadata) -> tuple:
            with set_forward_context(meta):
                hidden = self.target_model(self.ids[:rows], self.pos[:rows])
            if self.hidden_sink is not None:  # padding rows' slots are -1
                self.hidden_sink.write_padded(hidden, meta.slot_mapping)
            if self.logits_out is None:
                return hidden, self.target_model.compute_logits(hidden)
            return hidden, self.target_model.compute_logits(hidden, out=self.logits_out[:rows])
        return fn

    def _fill_mtp_rows(self, ids: torch.Tensor, hidden: torch.Tensor, rows: int) -> None:
        t = ids.shape[0]
        self.mtp_ids[:t].copy_(ids)
        self.hidden_in[:t].copy_(hidden)
        if rows > t:
            self.mtp_ids[t:rows].zero_()
            self.hidden_in[t:rows].zero_()

    def mtp_first(self, ids, pos, hidden, meta, spec_step_idx):
        bp, tp, v = self.active, self.prefill_rows, self.step_k
        if bp is None and tp is None:
            return super().mtp_first(ids, pos, hidden, meta, spec_step_idx)
        t = ids.shape[0]
        self._fill_mtp_rows(ids, hidden, tp or bp * (1 + v))
        if tp is not None:  # positions and layout as the step's pverify left them
            (out,) = self._run(("pfirst", tp, spec_step_idx), self._first_fn(1, spec_step_idx, tp), 1, step=False,
                               rows=tp)
        else:
            (out,) = self._run(("first", bp, spec_step_idx, v), self._first_fn(bp, spec_step_idx, bp * (1 + v)), bp,
                               step=False)
        return out[:t]

    def mtp_first_top(self, ids, pos, hidden, meta, spec_step_idx, last_rows, top):
        bp, v = self.active, self.step_k
        key = ("firsttop", bp, spec_step_idx, v)
        if bp is None or self.prefill_rows is not None:  # eager, or a prefill's pfirst unit via mtp_first
            return super().mtp_first_top(ids, pos, hidden, meta, spec_step_idx, last_rows, top)
        if self.mode == "cuda" and key not in self.graphs:  # not captured (no draft_fn at capture): eager
            out = EagerDraftForward.mtp_first(self, ids, pos, hidden, meta, spec_step_idx).index_select(0, last_rows)
            return out, top(out, spec_step_idx)
        b = self.num_seqs
        self._fill_mtp_rows(ids, hidden, bp * (1 + v))
        self.first_rows[:b].copy_(last_rows)
        if bp > b:  # padding sequences pick row 0 (their outputs are dropped)
            self.first_rows[b:bp].zero_()
        out, tok = self._run(key, self._first_top_fn(bp, spec_step_idx, bp * (1 + v), top), bp, step=False)
        return out[:b], tok[:b]

    def _first_top_fn(self, bp: int, idx: int, rows: int, top: DraftTokenFn) -> Callable[[AttentionMetadata], tuple]:
        first = self._first_fn(bp, idx, rows)

        def fn(meta: AttentionMetadata) -> tuple:
            (out,) = first(meta)
            last = out.index_select(0, self.first_rows[:bp])
            return last, top(last, idx)
        return fn

    def _first_fn(self, bp: int, idx: int, rows: int) -> Callable[[AttentionMetadata], tuple]:
        def fn(meta: AttentionMetadata) -> tuple:
            with set_forward_context(meta):
                return (self.mtp_model(self.mtp_ids[:rows], self.pos[:rows], self.hidden_in[:rows],
                                       spec_step_idx=idx),)
        return fn

    def mtp_kv_only(self, ids, pos, hidden, meta, spec_step_idx):
        bp, v = self.active, self.step_k
        if bp is None or not self.kv_only:  # eager steps, single-sequence prefills, no kvonly units: eager call
            return super().mtp_kv_only(ids, pos, hidden, meta, spec_step_idx)
        self._fill_mtp_rows(ids, hidden, bp * (1 + v))
        self._run(("kvonly", bp, spec_step_idx, v), self._kv_only_fn(bp * (1 + v), spec_step_idx), bp, step=False)
        return None

    def _kv_only_fn(self, rows: int, idx: int) -> Callable[[AttentionMetadata], tuple]:
        def fn(meta: AttentionMetadata) -> tuple:
            with set_forward_context(meta):
                self.mtp_model.forward_kv_only(self.mtp_ids[:rows], self.pos[:rows], self.hidden_in[:rows],
                                               spec_step_idx=idx)
            return ()
        return fn

    def _mixed_step_size(self, meta: AttentionMetadata, spec_step_idx: int, top) -> Optional[int]:
        """A step with prefill chunks runs its verify and first pass eagerly, but its draft steps
        are one row per sequence, as in a pure-decode step: the padded size whose ``step`` unit
        runs them (its block tables set from ``meta``), or ``None`` (eager: no such unit)."""
        b, w = meta.block_tables.shape
        bp = self.padded(b)
        if (not self.mixed or bp is None or self.capture_failed is not None or w > self.block_tables.shape[1]
                or b != meta.num_seqs or (self.mode == "cuda" and ("step", bp, spec_step_idx, top is not None)
                                          not in self.graphs)):
            return None
        if self.mixed_tables is not meta.block_tables:  # once per step's tables (begin_step resets it)
            if self.mixed_tables is None:
                self.num_mixed_graph_steps += 1
            self.num_seqs = b
            self._set_tables(meta.block_tables, b, bp)
            self.mixed_tables = meta.block_tables
        return bp

    def mtp_step(self, ids, pos, hidden, meta, spec_step_idx, top):
        bp = 1 if self.prefill_rows is not None else self.active  # a prefill's drafts: the Bp = 1 units
        if bp is None:
            bp = self._mixed_step_size(meta, spec_step_idx, top)
        if bp is None:
            return super().mtp_step(ids, pos, hidden, meta, spec_step_idx, top)
        b = self.num_seqs
        self.s_ids[:b].copy_(ids)
        self.s_pos[:b].copy_(pos)
        self.s_slots[:b].copy_(meta.slot_mapping)
        self.s_qsl[:b + 1].copy_(meta.query_start_loc)
        self.s_seq_lens[:b].copy_(meta.seq_lens)
        self.s_hidden[:b].copy_(hidden)
        if bp > b:  # padding sequences
            self.s_ids[b:bp].zero_()
            self.s_pos[b:bp].zero_()
            self.s_slots[b:bp].fill_(-1)
            self.s_qsl[b + 1:bp + 1].fill_(b)
            self.s_seq_lens[b:bp].zero_()
            self.s_hidden[b:bp].zero_()
        key = ("step", bp, spec_step_idx, top is not None)
        out, tok = self._run(key, self._step_fn(bp, spec_step_idx, top), bp, step=True)
        return out[:b], (tok[:b] if tok is not None else None)

    def _step_fn(self, bp: int, idx: int, top: Optional[DraftTokenFn]) -> Callable[[AttentionMetadata], tuple]:
        def fn(meta: AttentionMetadata) -> tuple:
            with set_forward_context(meta):
                out = self.mtp_model(self.s_ids[:bp], self.s_pos[:bp], self.s_hidden[:bp], spec_step_idx=idx)
            return out, (top(out, idx) if top is not None else None)
        return fn

    # ---------------------------------------------------------------- capture
    @torch.inference_mode()
    def capture(self, proposer: Optional[Proposer]) -> None:
        """Capture every unit for every size (``"cuda"`` mode); on failure log once and stay eager.

        Per size and verify width ``v`` of :attr:`ks`: ``verify``; the proposer's first-pass units
        between its ``on_prefill_begin`` / ``on_prefill_end`` (with the captured layout); the
        ``kvonly`` units (adaptive). Per size: its step units between
        ``on_multi_step_decode_begin`` / ``_end(Bp, k - 1)``.

        Args:
            proposer: names the draft units (:meth:`~mtpspec.spec_decode.proposer.Proposer.graph_units`);
                ``None``: plain decoding, ``verify`` only.
        """
        if self.mode != "cuda":
            return
        units = proposer.graph_units() if proposer is not None else None
        self._capturing = None
        try:
            for bp in sorted(self.sizes, reverse=True):
                for v in self.ks:
                    meta = self.dummy_layout(bp, v)
                    self._capture_as(("verify", bp, v), self._verify_fn(bp, v), meta)
                    if units is None:
                        continue
                    proposer.on_prefill_begin(meta)
                    for key in self.first_pass_keys(bp, v, units):
                        self._capture_as(key, self.unit_fn(key, units.draft_fn), meta)
                    proposer.on_prefill_end(meta)
                    if self.kv_only:
                        for i in units.first_pass_layers:
                            self._capture_as(("kvonly", bp, i, v), self._kv_only_fn(bp * (1 + v), i), meta)
                if units is None:
                    continue
                step_meta = self._meta(bp, host=False, step=True)
                proposer.on_multi_step_decode_begin(bp, self.k - 1)
                for i, wt in units.step_units:
                    fn = self._step_fn(bp, i, units.draft_fn if wt else None)
                    self._capture_as(("step", bp, i, wt), fn, step_meta)
                proposer.on_multi_step_decode_end(bp, self.k - 1)
        except Exception as exc:  # noqa: BLE001 - any capture problem means: run eagerly, say why once
            done = len(self.graphs)
            self.graphs.clear()
            first = (str(exc).splitlines() or [""])[0]
            where = (f"at unit {self._capturing}" if self._capturing is not None else "between units")
            self.capture_failed = (f"CUDA graph capture failed {where} after {done} units "
                                   f"({type(exc).__name__}: {first})")
            if "out of memory" in first.lower():  # the graphs are captured after the KV cache took its share
                self.capture_failed += ("; leave the graphs room: lower gpu_memory_utilization "
                                        "(--gpu-memory-utilization) or num_kv_blocks (--num-kv-blocks)")
            logger.warning("%s; decode steps run eagerly", self.capture_failed)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return
        try:
            self._capture_prefill(proposer, units)
        except Exception as exc:  # noqa: BLE001 - prefill units are optional: drop them, keep the decode ones
            for key in [key for key in self.graphs if key[0] in ("pverify", "pfirst")]:
                del self.graphs[key]
            self.prefill_sizes = []
            first = (str(exc).splitlines() or [""])[0]
            logger.warning("prefill CUDA graph capture failed (%s: %s); prefills run eagerly", type(exc).__name__,
                           first)
            if torch.cuda.is_available():
                torch.cuda.synchronize()

    @staticmethod
    def first_pass_keys(bp: int, v: int, units: GraphUnits) -> List[tuple]:
        """The first-pass units of batch ``bp`` and width ``v``, in call order: ``("firsttop", bp,
        i0, v)`` for the first used layer when the proposer has a ``draft_fn``, ``("first", bp, i,
        v)`` for the others (the module docstring)."""
        return [("firsttop" if j == 0 and units.draft_fn is not None else "first", bp, i, v)
                for j, i in enumerate(units.first_pass_layers)]

    def unit_fn(self, key: tuple, draft_fn: Optional[DraftTokenFn] = None) -> Callable[[AttentionMetadata], tuple]:
        """The function of decode unit ``key`` (as :meth:`capture` names them): ``("verify", Bp, v)``,
        ``("first", Bp, i, v)``, ``("firsttop", Bp, i, v)``, ``("kvonly", Bp, i, v)`` or ``("step",
        Bp, i, with_top)`` (``draft_fn`` picks the draft token in ``firsttop`` and in a step unit with
        ``with_top``).

        Raises:
            ValueError: another key."""
        kind, bp = key[0], key[1]
        if kind == "verify":
            return self._verify_fn(bp, key[2])
        if kind == "first":
            return self._first_fn(bp, key[2], bp * (1 + key[3]))
        if kind == "firsttop":
            return self._first_top_fn(bp, key[2], bp * (1 + key[3]), draft_fn)
        if kind == "kvonly":
            return self._kv_only_fn(bp * (1 + key[3]), key[2])
        if kind == "step":
            return self._step_fn(bp, key[2], draft_fn if key[3] else None)
        raise ValueError(f"unknown decode unit {key!r}")

    def time_unit(self, key: tuple, repeats: int, draft_fn: Optional[DraftTokenFn] = None) -> float:
        """Median milliseconds of decode unit ``key`` (:meth:`unit_fn`) over ``repeats`` calls after
        one warm-up, on the layout in the static buffers (:meth:`dummy_layout` of its width): its
        CUDA-graph replay when captured, else its function through the static buffers (CUDA events
        on a GPU, ``perf_counter`` on the CPU; :func:`mtpspec.timing.median_call_ms`)."""
        if key in self.graphs:
            call = self.graphs[key][0].replay
        else:
            fn = self.unit_fn(key, draft_fn)
            meta = self._meta(key[1], host=True, step=key[0] == "step")
            call = lambda: fn(meta)  # noqa: E731
        return median_call_ms(call, repeats, warmup=1, cuda=self.qsl.device.type == "cuda")

    def dummy_layout(self, bp: int, v: int) -> AttentionMetadata:
        """Dummy but valid inputs in the static buffers (capture, cost calibration): ``bp``
        sequences of ``1 + v`` tokens in block 0's slots, single-row step buffers; sets
        :attr:`step_k` to ``v``; returns the graph metadata of that layout."""
        self.step_k = v
        rows = bp * (1 + v)
        dev = self.qsl.device
        self.qsl[:bp + 1].copy_(torch.arange(bp + 1, device=dev) * (1 + v))
        self.seq_lens[:bp].fill_(1 + v)
        self.slots[:rows].copy_(torch.arange(rows, device=dev) % (1 + v))
        self.block_tables[:bp].fill_(-1)
        self.block_tables[:bp, 0] = 0
        self.s_qsl[:bp + 1].copy_(torch.arange(bp + 1, device=dev))
        self.s_seq_lens[:bp].fill_(1)
        self.s_slots[:bp].zero_()
        return self._meta(bp, host=self.mode == "static", step=False)

    def _capture_prefill(self, proposer: Optional[Proposer], units) -> None:
        """The prefill units: dummy one-sequence layouts of ``Tp`` rows at positions ``0 .. Tp - 1``
        that write nothing (slots ``-1``) and read block 0 for every position."""
        for tp in sorted(self.prefill_sizes, reverse=True):
            self.qsl[:2].copy_(torch.tensor([0, tp], device=self.qsl.device))
            self.seq_lens[:1].fill_(tp)
            self.pos[:tp].copy_(torch.arange(tp, device=self.pos.device))
            self.slots[:tp].fill_(-1)
            self.block_tables[:1].fill_(0)
            self.p_sample.fill_(tp - 1)
            meta = self._meta(1, host=False, step=False, rows=tp)
            self.graphs[("pverify", tp)] = self._capture_one(self._pverify_fn(tp), meta)
            if units is None:
                continue
            proposer.on_prefill_begin(meta)
            for i in units.first_pass_layers:
                self.graphs[("pfirst", tp, i)] = self._capture_one(self._first_fn(1, i, tp), meta)
            proposer.on_prefill_end(meta)

    def _capture_as(self, key: tuple, fn: Callable[[AttentionMetadata], tuple], meta: AttentionMetadata) -> None:
        self._capturing = key  # named by capture_failed if this one fails
        self.graphs[key] = self._capture_one(fn, meta)
        self._capturing = None

    def _capture_one(self, fn: Callable[[AttentionMetadata], tuple], meta: AttentionMetadata):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn(meta)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn(meta)
        self.pool = graph.pool()
        return graph, outputs

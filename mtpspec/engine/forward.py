"""How the runner calls the models: eagerly, or for pure-decode steps through padded static
buffers replayed as CUDA graphs.

Graph units (one per padded batch size ``Bp`` from :func:`capture_sizes`, which covers every
batch up to ``max_num_seqs``):

* ``verify``: target forward over ``Bp x (1 + k)`` rows + ``compute_logits`` of every row
  (``k = 0``: the plain decode step);
* ``first`` (per used MTP layer): the MTP first pass over the same rows;
* ``step`` (per ``spec_step_idx``): one MTP row per sequence, + the greedy draft when wanted.

The proposer names its units (:meth:`~mtpspec.spec_decode.proposer.Proposer.graph_units`) and
capture brackets them with its lifecycle hooks, as :meth:`~mtpspec.spec_decode.proposer.Proposer.propose`
does at run time. The draft-model calls implement the proposer's
:class:`~mtpspec.spec_decode.draft_forward.DraftForward`.

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
from typing import Callable, Dict, List, Optional, Tuple

import torch

from mtpspec.layers.attention import AttentionMetadata, set_forward_context
from mtpspec.spec_decode.draft_forward import DraftTokenFn, EagerDraftForward
from mtpspec.spec_decode.proposer import Proposer

logger = logging.getLogger(__name__)


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

    def begin_step(self, pure_decode: bool, num_seqs: int, block_tables: torch.Tensor) -> None:
        """Called once per step before any forward."""

    def verify(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
               sample_rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Target hidden states ``[T, H]`` and logits of ``sample_rows`` ``[R, V]``."""
        with set_forward_context(meta):
            hidden = self.target_model(ids, pos)
        return hidden, self.target_model.compute_logits(hidden.index_select(0, sample_rows))


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
    """

    def __init__(self, target: torch.nn.Module, mtp: Optional[torch.nn.Module], k: int, max_num_seqs: int,
                 max_blocks_per_seq: int, hidden_size: int, dtype: torch.dtype, device: torch.device, mode: str,
                 max_seq_len: int):
        super().__init__(target, mtp)
        if mode not in ("cuda", "static"):
            raise ValueError(f"graph mode must be 'cuda' or 'static', got {mode!r}")
        self.k, self.mode, self.max_seq_len = k, mode, max_seq_len
        self.sizes = capture_sizes(max_num_seqs)
        bmax, tmax = max_num_seqs, max_num_seqs * (1 + k)
        z = lambda *s, dt=torch.int64: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
        self.ids, self.pos, self.slots = z(tmax), z(tmax), z(tmax)
        self.qsl, self.seq_lens = z(bmax + 1, dt=torch.int32), z(bmax, dt=torch.int32)
        self.block_tables = torch.full((bmax, max_blocks_per_seq), -1, dtype=torch.int32, device=device)
        self.mtp_ids, self.hidden_in = z(tmax), torch.zeros(tmax, hidden_size, dtype=dtype, device=device)
        self.s_ids, self.s_pos, self.s_slots = z(bmax), z(bmax), z(bmax)
        self.s_qsl, self.s_seq_lens = z(bmax + 1, dt=torch.int32), z(bmax, dt=torch.int32)
        self.s_hidden = torch.zeros(bmax, hidden_size, dtype=dtype, device=device)
        self.graphs: Dict[tuple, Tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.pool = None
        self.capture_failed: Optional[str] = None
        self.active: Optional[int] = None  # padded batch size of the current step, or None (eager)
        self.num_seqs = 0
        self.num_graph_steps = 0  # steps that ran through the static buffers / graphs
        self._warned = False

    # ---------------------------------------------------------------- metadata over the buffers
    def _meta(self, bp: int, host: bool, step: bool) -> AttentionMetadata:
        rows = bp if step else bp * (1 + self.k)
        qsl, sl, slots = (self.s_qsl, self.s_seq_lens, self.s_slots) if step else (self.qsl, self.seq_lens, self.slots)
        q_lens: List[int] = []
        s_lens: List[int] = []
        if host:  # static mode: exact host lists (free on CPU); never inside a captured graph
            q_host = qsl[:bp + 1].tolist()
            q_lens = [b - a for a, b in zip(q_host, q_host[1:])]
            s_lens = sl[:bp].tolist()
        return AttentionMetadata(query_start_loc=qsl[:bp + 1], seq_lens=sl[:bp], slot_mapping=slots[:rows],
                                 block_tables=self.block_tables[:bp], num_seqs=bp,
                                 max_query_len=1 if step else 1 + self.k, max_seq_len=self.max_seq_len,
                                 query_lens=q_lens, seq_lens_list=s_lens)

    def _padded(self, b: int) -> Optional[int]:
        return next((s for s in self.sizes if s >= b), None)

    # ---------------------------------------------------------------- per step
    def begin_step(self, pure_decode: bool, num_seqs: int, block_tables: torch.Tensor) -> None:
        self.active = None
        if not pure_decode:
            return
        bp = self._padded(num_seqs)
        if bp is None or self.capture_failed is not None:
            self.num_eager_fallbacks += 1
            if not self._warned:
                self._warned = True
                why = self.capture_failed or f"batch of {num_seqs} exceeds the largest graph ({self.sizes[-1]})"
                logger.warning("decode step runs eagerly instead of through a CUDA graph: %s (logged once; "
                               "every such step is counted in num_eager_fallbacks)", why)
            return
        self.active, self.num_seqs = bp, num_seqs
        self.num_graph_steps += 1
        w = block_tables.shape[1]
        self.block_tables[:num_seqs].fill_(-1)
        self.block_tables[:num_seqs, :w].copy_(block_tables)
        self.block_tables[num_seqs:bp].fill_(-1)

    def _run(self, key: tuple, fn: Callable[[AttentionMetadata], tuple], bp: int, step: bool) -> tuple:
        if self.mode == "static":
            return fn(self._meta(bp, host=True, step=step))
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs

    def verify(self, ids, pos, meta, sample_rows):
        bp = self.active
        if bp is None:
            return super().verify(ids, pos, meta, sample_rows)
        b, t = self.num_seqs, ids.shape[0]
        self.ids[:t].copy_(ids)
        self.ids[t:bp * (1 + self.k)].zero_()
        self.pos[:t].copy_(pos)
        self.pos[t:bp * (1 + self.k)].zero_()
        self.slots[:t].copy_(meta.slot_mapping)
        self.slots[t:bp * (1 + self.k)].fill_(-1)
        self.qsl[:b + 1].copy_(meta.query_start_loc)
        self.qsl[b + 1:bp + 1].fill_(t)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.seq_lens[b:bp].zero_()
        hidden, logits = self._run(("verify", bp), self._verify_fn(bp), bp, step=False)
        return hidden[:t], logits[:t]  # decode: every row is a sample row

    def _verify_fn(self, bp: int) -> Callable[[AttentionMetadata], tuple]:
        rows = bp * (1 + self.k)

        def fn(meta: AttentionMetadata) -> tuple:
            with set_forward_context(meta):
                hidden = self.target_model(self.ids[:rows], self.pos[:rows])
            return hidden, self.target_model.compute_logits(hidden)
        return fn

    def mtp_first(self, ids, pos, hidden, meta, spec_step_idx):
        bp = self.active
        if bp is None:
            return super().mtp_first(ids, pos, hidden, meta, spec_step_idx)
        t, rows = ids.shape[0], bp * (1 + self.k)
        self.mtp_ids[:t].copy_(ids)
        self.mtp_ids[t:rows].zero_()
        self.hidden_in[:t].copy_(hidden)
        self.hidden_in[t:rows].zero_()
        (out,) = self._run(("first", bp, spec_step_idx), self._first_fn(bp, spec_step_idx), bp, step=False)
        return out[:t]

    def _first_fn(self, bp: int, idx: int) -> Callable[[AttentionMetadata], tuple]:
        rows = bp * (1 + self.k)

        def fn(meta: AttentionMetadata) -> tuple:
            with set_forward_context(meta):
                return (self.mtp_model(self.mtp_ids[:rows], self.pos[:rows], self.hidden_in[:rows],
                                       spec_step_idx=idx),)
        return fn

    def mtp_step(self, ids, pos, hidden, meta, spec_step_idx, top):
        bp = self.active
        if bp is None:
            return super().mtp_step(ids, pos, hidden, meta, spec_step_idx, top)
        b = self.num_seqs
        self.s_ids[:b].copy_(ids)
        self.s_ids[b:bp].zero_()
        self.s_pos[:b].copy_(pos)
        self.s_pos[b:bp].zero_()
        self.s_slots[:b].copy_(meta.slot_mapping)
        self.s_slots[b:bp].fill_(-1)
        self.s_qsl[:b + 1].copy_(meta.query_start_loc)
        self.s_qsl[b + 1:bp + 1].fill_(b)
        self.s_seq_lens[:b].copy_(meta.seq_lens)
        self.s_seq_lens[b:bp].zero_()
        self.s_hidden[:b].copy_(hidden)
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

        Per size: ``verify``; the proposer's first-pass units between its ``on_prefill_begin`` /
        ``on_prefill_end`` (with the captured layout); its step units between
        ``on_multi_step_decode_begin`` / ``_end(Bp, k - 1)``.

        Args:
            proposer: names the draft units (:meth:`~mtpspec.spec_decode.proposer.Proposer.graph_units`);
                ``None``: plain decoding, ``verify`` only.
        """
        if self.mode != "cuda":
            return
        units = proposer.graph_units() if proposer is not None else None
        try:
            for bp in sorted(self.sizes, reverse=True):
                b_rows = bp * (1 + self.k)
                # Dummy but valid inputs: sequence i holds 1 + k tokens in block i's slots.
                self.qsl[:bp + 1].copy_(torch.arange(bp + 1, device=self.qsl.device) * (1 + self.k))
                self.seq_lens[:bp].fill_(1 + self.k)
                self.slots[:b_rows].copy_(torch.arange(b_rows, device=self.slots.device) % (1 + self.k))
                self.block_tables[:bp].fill_(-1)
                self.block_tables[:bp, 0] = 0
                self.s_qsl[:bp + 1].copy_(torch.arange(bp + 1, device=self.qsl.device))
                self.s_seq_lens[:bp].fill_(1)
                self.s_slots[:bp].zero_()
                meta = self._meta(bp, host=False, step=False)
                self.graphs[("verify", bp)] = self._capture_one(self._verify_fn(bp), meta)
                if units is None:
                    continue
                proposer.on_prefill_begin(meta)
                for i in units.first_pass_layers:
                    self.graphs[("first", bp, i)] = self._capture_one(self._first_fn(bp, i), meta)
                proposer.on_prefill_end(meta)
                step_meta = self._meta(bp, host=False, step=True)
                proposer.on_multi_step_decode_begin(bp, self.k - 1)
                for i, wt in units.step_units:
                    fn = self._step_fn(bp, i, units.draft_fn if wt else None)
                    self.graphs[("step", bp, i, wt)] = self._capture_one(fn, step_meta)
                proposer.on_multi_step_decode_end(bp, self.k - 1)
        except Exception as exc:  # noqa: BLE001 - any capture problem means: run eagerly, say why once
            self.graphs.clear()
            first = (str(exc).splitlines() or [""])[0]
            self.capture_failed = f"CUDA graph capture failed ({type(exc).__name__}: {first})"
            logger.warning("%s; decode steps run eagerly", self.capture_failed)
            if torch.cuda.is_available():
                torch.cuda.synchronize()

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

"""Per-rank executor of one engine step: prepare -> verify -> accept -> propose -> copy out.

Every tensor-parallel rank runs the same :meth:`ModelRunner.execute_model` on the same
:class:`~mtpspec.step_io.StepInput`. Logits are all-gathered and the random draws are
counter-based (:mod:`mtpspec.sample.counter_rng`), so every rank computes the same tokens and the
same accepted counts, hence the same shapes and the same collectives in the same order. The
only device-to-host transfer of a step is the final ``[B, 2k + 1]`` token block.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

import torch

from mtpspec.config import SpeculativeConfig
from mtpspec.distributed import comm_stats
from mtpspec.engine import kv_cache
from mtpspec.engine.config import CacheConfig, SchedulerConfig
from mtpspec.engine.forward import EagerForward, GraphedForward
from mtpspec.engine.input_prep import prepare_step
from mtpspec.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from mtpspec.sample.sampler import Sampler
from mtpspec.spec_decode.proposer import Proposer, build_proposer
from mtpspec.step_io import PreparedStep, StepInput, StepOutput


def _bytes_sent(stats: dict) -> dict:
    return {op: v["bytes_sent"] for op, v in stats.items()}


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
        graph_mode: ``"auto"`` (CUDA graphs for pure-decode steps on a GPU, eager otherwise), ``"off"``, ``"cuda"`` or ``"static"`` (see
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
        self.kv_dtype = next(target.parameters()).dtype
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        self.proposer: Optional[Proposer] = None
        if spec is not None:
            if mtp is None:
                raise ValueError("speculative decoding needs the MTP model")
            self.proposer = build_proposer(spec, mtp, block_size=cache_config.block_size, max_position=max_position,
                                           max_num_seqs=scheduler_config.max_num_seqs)
        self.layers = kv_cache.attention_layers(target, mtp)
        self.num_blocks = 0
        if graph_mode == "auto":
            graph_mode = "cuda" if device.type == "cuda" else "off"
        if graph_mode not in ("off", "cuda", "static"):
            raise ValueError(f"graph_mode must be 'auto', 'off', 'cuda' or 'static', got {graph_mode!r}")
        self.graph_mode = graph_mode
        self.fwd: EagerForward = EagerForward(target, mtp)
        if graph_mode != "off":
            sc = scheduler_config
            width = -(-sc.decode_slots(sc.max_model_len) // cache_config.block_size)
            self.fwd = GraphedForward(target, mtp, self.k, sc.max_num_seqs, width, target.config.hidden_size,
                                      self.kv_dtype, device, graph_mode, sc.decode_slots(sc.max_model_len))

    # ------------------------------------------------------------------ KV cache
    def max_useful_blocks(self) -> int:
        sc = self.scheduler_config
        per_seq = -(-sc.decode_slots(sc.max_model_len) // self.cache_config.block_size)
        return sc.max_num_seqs * per_seq

    @torch.inference_mode()
    def profile_and_count_blocks(self) -> int:
        """Blocks this rank can hold; on CUDA after a profiling forward of ``max_num_batched_tokens`` tokens."""
        if self.device.type == "cuda" and self.cache_config.num_kv_blocks is None:
            n = min(self.scheduler_config.max_num_batched_tokens, self.max_position)
            ids = torch.zeros(n, dtype=torch.int64, device=self.device)
            pos = torch.arange(n, device=self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            hidden = self.target(ids, pos)
            self.target.compute_logits(hidden[: self.scheduler_config.max_num_seqs * (1 + self.k)])
            if self.mtp is not None:
                self.mtp(ids, pos, hidden, spec_step_idx=0)
            torch.cuda.synchronize(self.device)
            del hidden
            torch.cuda.empty_cache()
        return kv_cache.available_kv_blocks(self.layers, self.cache_config, self.kv_dtype, self.device,
                                            self.max_useful_blocks())

    def init_kv_cache(self, num_blocks: int) -> None:
        """Attach ``num_blocks``-block caches to every target and MTP attention layer."""
        self.num_blocks = num_blocks
        kv_cache.allocate(self.layers, num_blocks, self.cache_config.block_size, self.kv_dtype, self.device)
        if isinstance(self.fwd, GraphedForward):
            self.fwd.capture(self.proposer)

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, step: StepInput) -> StepOutput:
        """Run one step: prepare -> verify -> accept -> propose -> copy out.

        Returns:
            per sequence in batch order, the emitted tokens and the next ``k`` drafts (one
            device -> host copy), with the step's eager fall-backs, collective bytes and wall time.

        Raises:
            ValueError: a malformed ``step`` (see :func:`~mtpspec.engine.input_prep.prepare_step`).
        """
        t0, comm0, fallbacks0 = time.perf_counter(), _bytes_sent(comm_stats()), self.fwd.num_eager_fallbacks
        inp = self._prepare(step)
        hidden, logits = self.fwd.verify(inp.input_ids, inp.positions, inp.attn_metadata, inp.sample_rows)
        tokens, last_row = self._accept(inp, logits)
        drafts = self._propose(inp, hidden, tokens, last_row)
        new_tokens, drafts_out = self._copy_out(tokens, drafts, inp.host_partial)
        comm1 = _bytes_sent(comm_stats())
        delta = {op: comm1[op] - comm0.get(op, 0) for op in comm1 if comm1[op] != comm0.get(op, 0)}
        return StepOutput(new_tokens, drafts_out, self.fwd.num_eager_fallbacks - fallbacks0, delta,
                          time.perf_counter() - t0)

    def _prepare(self, step: StepInput) -> PreparedStep:
        """Device tensors of ``step``; tells the forward the batch (graph buffers for pure decodes)."""
        inp = prepare_step(step, self.k, self.cache_config.block_size, self.max_position, self.device)
        self.fwd.begin_step(step.is_pure_decode, len(step.seqs), inp.block_tables)
        return inp

    def _accept(self, inp: PreparedStep, logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Verify the decodes' drafts (rejection sampler) and sample the prefills (sampler).

        Returns:
            tokens ``[B, k + 1]`` int64 (:data:`PLACEHOLDER_TOKEN_ID`-padded; all placeholders for
            a partial prefill chunk, which samples nothing) and each sequence's last valid row
            offset ``[B]`` int64 (accepted drafts; ``q - 1`` for a prefill or a chunk).
        """
        k = self.k
        nd, npf = inp.num_decodes, inp.num_prefills
        parts, last = [], []
        if nd:
            dec_logits = logits[: nd * (k + 1)].view(nd, k + 1, -1)
            res = self.rejection_sampler(inp.draft_token_ids, dec_logits, inp.decode_meta, inp.accept_uniforms,
                                         inp.decode_sample_uniforms)
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
        return torch.cat(parts), torch.cat(last)

    def _propose(self, inp: PreparedStep, hidden: torch.Tensor, tokens: torch.Tensor,
                 last_row: torch.Tensor) -> Optional[torch.Tensor]:
        """The next drafts ``[B, k]`` int64 from the proposer, or ``None`` without one.

        A partial prefill chunk's newest token is the prompt token after it
        (``inp.next_token_ids``): the MTP first pass writes the same KV entries as a whole
        prefill; the drafts it yields are dropped by :meth:`_copy_out`.
        """
        if self.proposer is None:
            return None
        new_tok = tokens.gather(1, last_row_tok_index(inp, last_row).unsqueeze(1)).squeeze(1)
        if inp.next_token_ids is not None:
            new_tok = torch.where(inp.next_token_ids >= 0, inp.next_token_ids, new_tok)
        host_last = last_row.tolist() if self.device.type == "cpu" else None
        return self.proposer.propose(inp, hidden, new_tok, last_row, host_last, self.fwd)

    def _copy_out(self, tokens: torch.Tensor, drafts: Optional[torch.Tensor],
                  partial: Sequence[int] = ()) -> Tuple[List[List[int]], List[List[int]]]:
        """The step's single device -> host transfer: emitted tokens (placeholders cut) and drafts
        (none for the batch indices in ``partial``: partial prefill chunks)."""
        k = self.k
        result = tokens if drafts is None else torch.cat([tokens, drafts.view(tokens.shape[0], k)], dim=1)
        host = result.cpu().tolist()
        new_tokens, drafts_out = [], []
        for row in host:
            emitted = row[:k + 1]
            n = next((i for i, t in enumerate(emitted) if t == PLACEHOLDER_TOKEN_ID), len(emitted))
            new_tokens.append(emitted[:n])
            drafts_out.append(row[k + 1:])
        for i in partial:
            drafts_out[i] = []
        return new_tokens, drafts_out


def last_row_tok_index(inp: PreparedStep, last_row: torch.Tensor) -> torch.Tensor:
    """Column of each sequence's newest token in the ``[B, k + 1]`` token block.

    Decodes: ``num_accepted``; prefills (and every row in plain decoding): column 0.
    """
    idx = last_row.clone()
    idx[inp.num_decodes:] = 0
    return idx

"""Per-rank executor of one engine step: target forward, sampling / verification, MTP drafting.

Every tensor-parallel rank runs the same :meth:`ModelRunner.execute_model` on the same
:class:`~mtpspec.step_io.StepInput`. Logits are all-gathered and the random draws are
counter-based (:mod:`mtpspec.sample.counter_rng`), so every rank computes the same tokens and the
same accepted counts, hence the same shapes and the same collectives in the same order. The
only device-to-host transfer of a step is the final ``[B, 2k + 1]`` token block.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from mtpspec.config import SpeculativeConfig
from mtpspec.distributed import comm_stats
from mtpspec.engine import kv_cache
from mtpspec.engine.config import CacheConfig, SchedulerConfig
from mtpspec.engine.input_prep import PreparedStep, prepare_step
from mtpspec.sample.sampler import Sampler
from mtpspec.step_io import StepInput, StepOutput
from mtpspec.engine.forward import EagerForward, GraphedForward
from mtpspec.spec_decode.mtp_proposer import MTPProposer
from mtpspec.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler


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
        self.proposer = None
        if spec is not None:
            if mtp is None:
                raise ValueError("speculative decoding needs the MTP model")
            self.proposer = MTPProposer(mtp, self.k, spec.use_local_argmax_reduction, cache_config.block_size,
                                        max_position)
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
            used = self.proposer._used_layers() if self.proposer is not None else []
            steps = [(j, True) for j in range(1, self.k)]
            steps += [(layer, False) for layer in used] if self.k > 2 and len(used) > 1 else []
            top = self.proposer._top if self.proposer is not None else None
            self.fwd.capture(steps, used, top)

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, step: StepInput) -> StepOutput:
        """Run one step. Returns per-sequence emitted tokens and next drafts (batch order)."""
        t0 = time.perf_counter()
        comm0 = _bytes_sent(comm_stats())
        k = self.k
        inp = prepare_step(step, k, self.cache_config.block_size, self.max_position, self.device)
        fallbacks0 = self.fwd.num_eager_fallbacks
        self.fwd.begin_step(step.is_pure_decode, len(step.seqs), inp.block_tables)
        hidden, logits = self.fwd.verify(inp.input_ids, inp.positions, inp.attn_metadata, inp.sample_rows)
        tokens, last_row = self._sample(inp, logits)
        result = tokens
        if self.proposer is not None:
            b = tokens.shape[0]
            new_tok = tokens.gather(1, last_row_tok_index(inp, last_row).unsqueeze(1)).squeeze(1)
            host_last = last_row.tolist() if self.device.type == "cpu" else None
            drafts = self.proposer.propose(inp, hidden, new_tok, last_row, host_last, self.fwd)
            result = torch.cat([tokens, drafts.view(b, k)], dim=1)
        host = result.cpu().tolist()  # the step's single device -> host transfer
        new_tokens, drafts_out = [], []
        for row in host:
            emitted = row[:k + 1]
            n = next((i for i, t in enumerate(emitted) if t == PLACEHOLDER_TOKEN_ID), len(emitted))
            new_tokens.append(emitted[:n])
            drafts_out.append(row[k + 1:])
        comm1 = _bytes_sent(comm_stats())
        delta = {op: comm1[op] - comm0.get(op, 0) for op in comm1 if comm1[op] != comm0.get(op, 0)}
        return StepOutput(new_tokens, drafts_out, self.fwd.num_eager_fallbacks - fallbacks0, delta,
                          time.perf_counter() - t0)

    def _sample(self, inp: PreparedStep, logits: torch.Tensor):
        """Tokens ``[B, k + 1]`` (placeholder-padded) and each sequence's last valid row offset ``[B]``."""
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
            sampled = self.sampler(logits[nd * (k + 1):], inp.prefill_meta, inp.prefill_uniforms)
            pad = sampled.new_full((npf, k), PLACEHOLDER_TOKEN_ID)
            parts.append(torch.cat([sampled.unsqueeze(1), pad], dim=1))
            q = torch.tensor(inp.host_query_lens[nd:], dtype=torch.int64)
            last.append((q - 1).to(self.device, non_blocking=True))
        return torch.cat(parts), torch.cat(last)


def last_row_tok_index(inp: PreparedStep, last_row: torch.Tensor) -> torch.Tensor:
    """Column of each sequence's newest token in the ``[B, k + 1]`` token block.

    Decodes: ``num_accepted``; prefills (and every row in plain decoding): column 0.
    """
    idx = last_row.clone()
    idx[inp.num_decodes:] = 0
    return idx

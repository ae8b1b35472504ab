"""Benchmark one verify step and one MTP draft step against their memory floors.

Model: random weights at GLM-4.5-Air width (hidden 4096, vocab 151552, 96 heads / 8 kv heads of
128, 128 routed experts of 1408 + 1 shared, top-8), ``--layers`` target layers (the first dense)
plus one MTP layer, bf16, tp 1. For each batch size (default 1 and 64 sequences, each with
``--context`` tokens already in the KV cache):

* verify step: target forward over ``B x (1 + k)`` tokens + ``compute_logits`` + greedy
  verification;
* draft step: one single-token MTP step for ``B`` sequences (embedding + ``fused_eh_norm``,
  ``eh_proj``, the MTP block (attention + MoE), the tail norm, the LM head matmul and the
  argmax), whole and piece by piece;
* engine step: ``ModelRunner.execute_model`` of a pure-decode step (host preparation,
  verification, first MTP pass, ``k - 1`` draft steps, the one device-to-host copy), wall time.

Each row is timed eagerly and, where the code can be captured, as a CUDA graph (a capture
that fails, e.g. because an op synchronises with the host, is reported with its reason).
Floors: the bytes a row must read at least once (weights it uses: for MoE only the experts the
router actually picked; KV entries it attends to; its activations), divided by the read
bandwidth measured in the same run (``x.sum()`` over 4 GiB). ``x floor`` = time / floor.

Usage: ``python3 benchmarks/bench_engine_step.py [--batch-sizes 1,64] [--k 3] [--context 1024]
[--layers 3] [--json out.json]``; ``--smoke`` runs a tiny model on CPU (no graphs) to prove
the script works.

``--arch deepseek_v3``: the same rows at DeepSeek-V3 width instead (hidden 7168, vocab 129280,
MLA with 128 heads (``--heads`` overrides), q_lora_rank 1536, kv_lora_rank 512 + rope 64, nope
128, v 128; 256 routed experts of 2048 + 1 shared, top-8 in 8 groups (top 4 groups); the first
layer dense (18432); YaRN rope as the released config), built through the model registry. Its
floors count the MLA weights (``q_a`` / ``q_b`` / ``kv_a`` / ``kv_b`` / ``o`` projections and
latent norms) and the latent cache, ``kv_lora_rank + qk_rope_head_dim`` values per token per
layer (every layer's cache bytes per token come from its own ``get_kv_cache_spec``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._timing import Timer, fmt, read_bandwidth  # noqa: E402
from mtpspec.config import ModelConfig, SpeculativeConfig  # noqa: E402
from mtpspec.engine.config import CacheConfig, SchedulerConfig  # noqa: E402
from mtpspec.engine.input_prep import prepare_step  # noqa: E402
from mtpspec.engine.model_runner import ModelRunner  # noqa: E402
from mtpspec.layers.attention import set_forward_context  # noqa: E402
from mtpspec.layers.fused_moe import FusedMoE, MoEGate  # noqa: E402
from mtpspec.models.registry import get_architecture  # noqa: E402
from mtpspec.sample.rejection_sampler import greedy_verify  # noqa: E402
from mtpspec.step_io import SeqInput, StepInput  # noqa: E402



def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--k", type=int, default=3, help="draft tokens per step")
    p.add_argument("--context", type=int, default=1024, help="tokens already cached per sequence")
    p.add_argument("--layers", type=int, default=3, help="target decoder layers (first dense, rest MoE)")
    p.add_argument("--arch", default="glm4_moe", choices=["glm4_moe", "deepseek_v3", "deepseek_v32"],
                   help="model width: GLM-4.5-Air (default), DeepSeek-V3 (MLA) or DeepSeek-V3.2 (MLA + DSA indexer, "
                        "index_topk 2048: adds a draft-step row with the MTP index sharing's reused selection)")
    p.add_argument("--heads", type=int, help="deepseek_v3(2) only: attention heads (default 128, as at tp 1)")
    p.add_argument("--draft-sampling", action="store_true",
                   help="issue 20: also time the draft step with sampled drafts at T = 1 (Gumbel-max, "
                        "get_sampled_tokens) next to the greedy one (get_top_tokens)")
    p.add_argument("--fp8-weights", action="store_true",
                   help="issue 19: FP8 block-scaled weights (128 x 128) for every linear layer and expert (the "
                        "embeddings, LM heads, norms, router and kv_b_proj stay bf16, as in DeepSeek's FP8 release)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="issue 19: the KV cache dtype")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--graph-mode", default="auto", choices=["auto", "off", "cuda"],
                   help="the engine runner's CUDA-graph mode for the 'engine step' row")
    p.add_argument("--disable-shared-experts-fusion", action="store_true",
                   help="keep each MoE's shared experts as their own MLP (the engine's default fuses them into the "
                        "routed experts after loading)")
    p.add_argument("--compile-block", action="store_true",
                   help="add a row: the MTP block's torch reference (kernels off while tracing) under torch.compile")
    p.add_argument("--profile-kernels", action="store_true",
                   help="also list each graphed row's CUPTI kernel times per replay (GPU; the verify step, the "
                        "draft step and the MTP block)")
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    return p.parse_args(argv)


def model_config(smoke: bool, layers: int, arch: str = "glm4_moe", heads: Optional[int] = None) -> ModelConfig:
    if arch in ("deepseek_v3", "deepseek_v32"):
        return deepseek_v3_config(smoke, layers, heads, sparse=arch == "deepseek_v32")
    if heads is not None:
        raise SystemExit("--heads is for --arch deepseek_v3 only")
    return ModelConfig.from_dict(glm_air_config_dict(smoke, layers))


def glm_air_config_dict(smoke: bool, layers: int) -> Dict[str, Any]:
    """The ``config.json`` dict of the GLM-4.5-Air-width model (tiny dims with ``smoke``)."""
    if smoke:
        dims = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    vocab_size=1000, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2)
    else:
        dims = dict(hidden_size=4096, intermediate_size=10944, num_attention_heads=96, num_key_value_heads=8,
                    head_dim=128, vocab_size=151552, moe_intermediate_size=1408, n_routed_experts=128,
                    num_experts_per_tok=8)
    return dict(
        architectures=["Glm4MoeForCausalLM"], num_hidden_layers=layers, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=1e6, partial_rotary_factor=0.5, attention_bias=True, first_k_dense_replace=1,
        n_shared_experts=1, routed_scaling_factor=1.0, n_group=1, topk_group=1, num_nextn_predict_layers=1,
        eos_token_id=0, **dims)


def deepseek_v3_config(smoke: bool, layers: int, heads: Optional[int], sparse: bool = False) -> ModelConfig:
    """DeepSeek-V3's released config.json at ``layers`` target layers (tiny dims with ``smoke``);
    ``sparse``: DeepSeek-V3.2's (the same plus the DSA indexer: 64 heads of 128, ``index_topk``
    2048; tiny: 4 heads of 16, top 8)."""
    if smoke:
        dims = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16,
                    qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=16, vocab_size=1000,
                    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                    max_position_embeddings=8192)
    else:
        dims = dict(hidden_size=7168, intermediate_size=18432, num_attention_heads=128, q_lora_rank=1536,
                    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280,
                    moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                    max_position_embeddings=163840)
    if heads is not None:
        dims["num_attention_heads"] = heads
    dims["num_key_value_heads"] = dims["num_attention_heads"]
    if sparse:
        dims.update(index_n_heads=4, index_head_dim=16, index_topk=8) if smoke else \
            dims.update(index_n_heads=64, index_head_dim=128, index_topk=2048)
    arch = ("DeepseekV32ForCausalLM", "deepseek_v32") if sparse else ("DeepseekV3ForCausalLM", "deepseek_v3")
    return ModelConfig.from_dict(dict(
        architectures=[arch[0]], model_type=arch[1], num_hidden_layers=layers,
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_interleave=True,
        rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                          mscale=1.0, mscale_all_dim=1.0),
        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        scoring_func="sigmoid", topk_method="noaux_tc", num_nextn_predict_layers=1, tie_word_embeddings=False,
        eos_token_id=1, **dims))


@torch.no_grad()
def randomise_(module: torch.nn.Module, seed: int) -> None:
    """Fill every parameter: norms 1, biases small, matrices N(0, 1 / fan_in)."""
    gens: Dict[torch.device, torch.Generator] = {}
    for name, p in module.named_parameters():
        g = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        if p.dtype == torch.float8_e4m3fn:  # FP8 weights: unit normal values, the scale carries 1 / sqrt(fan_in)
            p.copy_(torch.randn(p.shape, generator=g, device=p.device).clamp(-448, 448).to(p.dtype))
        elif name.endswith("scale_inv"):
            p.fill_(1.0 / math.sqrt(p.shape[-1] * 128))
        elif name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.dim() == 1:
            p.normal_(0.0, 0.02, generator=g)
        else:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=g)
    for name, b in module.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.zero_()


def param_bytes(module: torch.nn.Module, skip: Tuple[type, ...] = ()) -> int:
    total = 0
    for m in module.modules():
        if isinstance(m, skip):
            continue
        for p in m.parameters(recurse=False):
            total += p.numel() * p.element_size()
    return total


class ExpertCounter:
    """Forward hooks on every ``MoEGate``: distinct experts picked per call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.picked: List[int] = []
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, MoEGate)]

    def _hook(self, module: Any, inputs: Any, output: Any) -> None:
        self.picked.append(int(torch.unique(output[1]).numel()))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def expert_bytes(model: torch.nn.Module) -> int:
    """Bytes of one routed expert (gate + up + down) in ``model``'s first FusedMoE."""
    m = next(x for x in model.modules() if isinstance(x, FusedMoE))
    scales = sum(getattr(m, n)[0].numel() * 4 for n in ("w13_weight_scale_inv", "w2_weight_scale_inv")
                 if hasattr(m, n))
    return (m.w13_weight[0].numel() + m.w2_weight[0].numel()) * m.w13_weight.element_size() + scales


def decode_step(b: int, k: int, context: int, vocab: int, blocks_per_seq: int) -> StepInput:
    g = torch.Generator().manual_seed(b)
    seqs = []
    for i in range(b):
        ids = torch.randint(3, vocab, (k + 1,), generator=g).tolist()
        table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        seqs.append(SeqInput(ids, context, table, False))
    return StepInput(seqs)


#: blocks per graph in the "block (CHAIN per graph)" row (the graph's launch over CHAIN blocks)
CHAIN = 8


def add_compiled_block(rows: List[Dict[str, Any]], add: Callable[..., None], layer: Any, meta: Any, pos: Any, x: Any,
                       block: Callable[[], Any], block_floor: float, b: int) -> None:
    """The row "block, torch.compile ref": the block's torch reference under ``torch.compile``,
    checked against the kernels first; a failure becomes the row's note and its traceback goes to
    stderr (on the H200, 2026-12-04: Inductor's searchsorted lowering on a slice of
    ``query_start_loc``, since avoided in the attention references)."""
    import traceback
    compiled = torch.compile(layer.mtp_block, dynamic=False)

    def block_compiled() -> Any:
        with set_forward_context(meta):
            return compiled(pos, x, None)
    try:
        torch.testing.assert_close(block_compiled()[0].float(), block()[0].float(), rtol=0.05, atol=0.05)
        add("  block, torch.compile ref", block_compiled, block_floor)
    except Exception as exc:  # noqa: BLE001 - reported as the row's note
        traceback.print_exc()
        note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}"
        rows.append(dict(batch=b, row="  block, torch.compile ref", eager_ms=None, graph_ms=None, floor_ms=None,
                         eager_x=None, graph_x=None, graph_note=note))


def bench_batch(runner: ModelRunner, timer: Timer, b: int, k: int, context: int, bw: float,
                profile: bool = False, compile_block: bool = False) -> List[Dict[str, Any]]:
    target, mtp = runner.target, runner.mtp
    cfg = target.config
    dev, dtype = runner.device, runner.kv_dtype
    e = torch.empty((), dtype=dtype).element_size()
    cache_dtype = runner.cache_dtype  # the KV cache's (fp8: 1 byte a value)
    h, v = cfg.hidden_size, cfg.vocab_size
    # cache bytes per token of every layer (GQA: K and V of each kv head; MLA: one latent entry)
    bs = runner.cache_config.block_size
    kv_per_token = sum(layer.get_kv_cache_spec(bs, cache_dtype).page_size_bytes // bs for layer in runner.layers)
    kv_per_token_target = kv_per_token * cfg.num_hidden_layers // len(runner.layers)
    kv_per_token_mtp = kv_per_token - kv_per_token_target
    step = decode_step(b, k, context, v, -(-(context + 2 * k + 2) // bs))
    inp = prepare_step(step, k, bs, cfg.max_position_embeddings, dev)
    rows: List[Dict[str, Any]] = []

    def add(name: str, fn: Callable[[], Any], floor_bytes: float, graph: bool = True, per: int = 1) -> None:
        # per > 1: fn runs the op `per` times back to back; times are per op (a graph replay's
        # launch paid once over `per` ops, as in the engine's graphs, where the op is one of many)
        eager = timer.eager(fn) / per
        g, why = timer.capture(fn) if graph else (None, "not captured")
        g_ms = timer.eager(g.replay) / per if g is not None else None
        floor = floor_bytes / bw * 1e3
        rows.append(dict(batch=b, row=name, eager_ms=eager, graph_ms=g_ms, graph_note=why, floor_ms=floor,
                         eager_x=eager / floor if floor else None, graph_x=(g_ms / floor) if g_ms else None))
        if profile and g is not None and per == 1 and (not name.startswith("  ") or "block" in name):
            rows[-1]["kernels"] = timer.kernel_profile(g)  # the top rows and the block

    # ---- verify step
    drafts = inp.draft_token_ids

    def verify() -> Any:
        with set_forward_context(inp.attn_metadata):
            hidden = target(inp.input_ids, inp.positions)
        logits = target.compute_logits(hidden)
        return greedy_verify(drafts, logits.view(b, k + 1, -1)).output_token_ids

    counter = ExpertCounter(target)
    verify()
    moe_layers = sum(1 for layer in target.model.layers if layer.is_moe)
    experts_read = sum(counter.picked[-moe_layers:]) if moe_layers else 0
    counter.close()
    t_tokens = b * (1 + k)
    verify_floor = (param_bytes(target, (FusedMoE,)) - target.model.embed_tokens.weight.numel() * e
                    + experts_read * expert_bytes(target) + b * (context + k + 1) * kv_per_token_target
                    + t_tokens * v * 4)
    add(f"verify step ({t_tokens} tok)", verify, verify_floor)

    # ---- one draft step, whole and in pieces
    layer = mtp.get_layer(0)
    ids = drafts[:, 0].contiguous()
    prev = torch.randn(b, h, dtype=dtype, device=dev)
    pos = inp.start_positions + 1
    host_base = inp.start_positions.tolist() if dev.type == "cpu" else None
    ((meta, _),) = runner.proposer._steps_metadata(inp, inp.start_positions, 2, host_base)  # step 1: start + 1
    draft_fn = runner.proposer.graph_units().draft_fn
    head = layer.shared_head.head

    prop = runner.proposer
    sampled = getattr(prop, "sampled", None)

    def whole() -> Any:  # the greedy draft step (with draft sampling on, T = 0 rows take this path)
        with set_forward_context(meta):
            out = mtp(ids, pos, prev, spec_step_idx=0)
        return mtp.get_top_tokens(out, spec_step_idx=0) if sampled is not None else draft_fn(out, 0)

    def whole_sampled() -> Any:  # the same step drafting by Gumbel-max sampling (MTPProposer._sample_top)
        with set_forward_context(meta):
            out = mtp(ids, pos, prev, spec_step_idx=0)
        return prop._sample_top(out, 0)

    with set_forward_context(meta):
        emb = mtp.embed_tokens(ids)
        eh = layer.eh_input(emb, pos, prev)
        x = layer.eh_proj(eh)
        counter = ExpertCounter(layer)
        hb, res = layer.mtp_block(pos, x, None)
        experts_mtp = counter.picked[-1] if counter.picked else 0
        counter.close()
    from mtpspec.distributed.allreduce_rms_norm import fused_allreduce_rms_norm
    out, _ = fused_allreduce_rms_norm(hb, res, layer.shared_head.norm)
    local = F.linear(out, head.weight)
    blk = layer.mtp_block
    attn_bytes = param_bytes(blk.self_attn) + param_bytes(blk.input_layernorm) + param_bytes(blk.post_attention_layernorm)
    mlp = blk.mlp
    mlp_bytes = (param_bytes(mlp, (FusedMoE,)) + experts_mtp * expert_bytes(layer)) if blk.is_moe else param_bytes(mlp)
    block_floor = attn_bytes + mlp_bytes + b * (context + 1) * kv_per_token_mtp + 4 * b * h * e
    pieces = [
        ("  embed + eh_norm", lambda: layer.eh_input(mtp.embed_tokens(ids), pos, prev), 2 * b * h * e + 2 * b * 2 * h * e),
        ("  eh_proj", lambda: layer.eh_proj(eh), param_bytes(layer.eh_proj) + b * 3 * h * e),
        ("  block (attn + MoE)", None, block_floor),
        ("  tail norm", lambda: fused_allreduce_rms_norm(hb, res, layer.shared_head.norm), 3 * b * h * e),
        ("  head (matmul)", lambda: F.linear(out, head.weight), head.weight.numel() * e + b * v * e),
        ("  argmax", lambda: local[:, :v].argmax(dim=-1), b * v * e),
    ]
    step_floor = sum(p[2] for p in pieces)
    add(f"draft step ({b} tok)", whole, step_floor)
    if sampled is not None:  # T = 1 on every row; the matmul writes the kept local logits: the same floor
        sampled.temperature.fill_(1.0)
        sampled.seed_keys.copy_(torch.arange(sampled.seed_keys.shape[0], device=dev))
        sampled.base.zero_()
        add(f"draft step, sampled T=1", whole_sampled, step_floor)
        sampled.temperature.zero_()
    shared = share_states(mtp, k, b, meta, whole)
    if shared:  # DSA: the same step with the MTP indexer's selection shared (scoring skipped)
        for st in shared:
            st.set_mode("reuse")
        add(f"draft step, shared sel.", whole, step_floor)
        for st in shared:
            st.set_mode("off")

    def block() -> Any:
        with set_forward_context(meta):
            return layer.mtp_block(pos, x, None)

    for name, fn, floor_b in pieces:
        add(name, fn or block, floor_b)

    def blocks() -> Any:  # the block as a layer of the engine's graphs sees it: one after another
        with set_forward_context(meta):
            for _ in range(CHAIN):
                out = layer.mtp_block(pos, x, None)
        return out
    add(f"  block ({CHAIN} per graph)", blocks, block_floor, per=CHAIN)
    if compile_block:  # the torch reference compiled (use_triton() is False while torch.compile traces)
        add_compiled_block(rows, add, layer, meta, pos, x, block, block_floor, b)

    # ---- whole engine step (host included), eager
    t0 = time.perf_counter()
    for _ in range(timer.iters):
        runner.execute_model(step)
    wall = (time.perf_counter() - t0) / timer.iters * 1e3
    fwd = runner.fwd
    note = "eager" if not hasattr(fwd, "capture_failed") else (fwd.capture_failed or "graphs")
    rows.append(dict(batch=b, row=f"engine step (k={k}, wall)", eager_ms=wall, graph_ms=None, graph_note=note[:80],
                     floor_ms=None, eager_x=None, graph_x=None))
    return rows


def share_states(mtp: torch.nn.Module, k: int, b: int, meta: Any, whole: Callable[[], Any]) -> List[Any]:
    """For a DSA draft model: index-sharing states on its indexers, their anchors set to the
    selection one step of ``whole`` makes (positions one before the step's); else ``[]``."""
    from mtpspec.layers.indexer import Indexer
    from mtpspec.spec_decode.index_share import attach_index_share
    if not any(isinstance(m, Indexer) for m in mtp.modules()):
        return []
    states = attach_index_share(mtp, max(k, 2), b)
    whole()
    sel = mtp.index_selection(0)
    for st in states:
        st.anchor_sel[:b].copy_(sel[:b])
        st.anchor_pos[:b].copy_(meta.seq_lens[:b].long() - 2)
    return states


def table(rows: List[Dict[str, Any]], bw: float) -> str:
    out = [f"read bandwidth {bw / 1e9:.1f} GB/s", "",
           f"{'B':>3}  {'row':<28} {'eager ms':>9} {'graph ms':>9} {'floor ms':>9} {'eager x':>8} {'graph x':>8}  note"]
    for r in rows:
        out.append(f"{r['batch']:>3}  {r['row']:<28} {fmt(r['eager_ms']):>9} {fmt(r['graph_ms']):>9} "
                   f"{fmt(r['floor_ms']):>9} {fmt(r['eager_x'], 2):>8} {fmt(r['graph_x'], 2):>8}  "
                   f"{r['graph_note'] or ''}")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if args.smoke:
        args.context, args.iters = min(args.context, 64), min(args.iters, 3)
    cfg = model_config(args.smoke, args.layers, args.arch, args.heads)
    batches = [int(x) for x in args.batch_sizes.split(",")]
    k = args.k
    arch = get_architecture(cfg.architecture)
    from mtpspec.layers.fp8 import fp8_weights
    with torch.device(device), fp8_weights((128, 128) if args.fp8_weights else None):
        target = arch.target_class()(cfg, dtype).eval()
        mtp = arch.mtp_class()(cfg, target.model.embed_tokens, target.lm_head, False, True, False, dtype).eval()
    randomise_(target, 0)
    randomise_(mtp.model, 1)
    if not args.disable_shared_experts_fusion:  # as the engine loads a model (load_models(fuse_shared_experts=True))
        from mtpspec.models.loader import _fuse_shared_experts
        _fuse_shared_experts(target, mtp)
    spec = SpeculativeConfig(num_speculative_tokens=k, use_local_argmax_reduction=True,
                             draft_sampling="auto" if args.draft_sampling else "greedy")
    max_b = max(batches)
    block_size = cfg.arch.default_block_size  # the engine's default for the architecture
    per_seq = -(-(args.context + 2 * k + 2) // block_size)
    sched = SchedulerConfig(max_num_seqs=max_b, max_model_len=args.context + 2 * k + 2, num_speculative_tokens=k)
    cache = CacheConfig(block_size, num_kv_blocks=max_b * per_seq, cache_dtype=args.kv_cache_dtype)
    runner = ModelRunner(target, mtp, spec, cache, sched, device, cfg.max_position_embeddings, args.graph_mode)
    runner.init_kv_cache(max_b * per_seq)
    bw = read_bandwidth(device)
    timer = Timer(device, args.iters)
    rows: List[Dict[str, Any]] = []
    with torch.inference_mode():
        for b in batches:
            rows += bench_batch(runner, timer, b, k, args.context, bw, args.profile_kernels, args.compile_block)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, {dtype}, hidden "
          f"{cfg.hidden_size}, vocab {cfg.vocab_size}, {args.layers} layers + 1 MTP, k={k}, context {args.context}; "
          f"weights {'FP8 128x128 block-scaled' if args.fp8_weights else 'model dtype'}, KV cache {args.kv_cache_dtype}")
    if args.arch == "deepseek_v3":
        print(f"DeepSeek-V3 MLA: {cfg.num_attention_heads} heads, q_lora_rank {cfg.q_lora_rank}, kv_lora_rank "
              f"{cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim} cached per token per layer; {cfg.n_routed_experts} "
              f"experts of {cfg.moe_intermediate_size}, top {cfg.num_experts_per_tok} ({cfg.n_group} groups, top "
              f"{cfg.topk_group}), first {cfg.first_k_dense_replace} dense ({cfg.intermediate_size})")
    print(table(rows, bw))
    for r in rows:
        prof = r.get("kernels")
        if prof:
            print(f"\nB={r['batch']} {r['row'].strip()}: kernels busy {prof['busy_ms'] * 1e3:.1f} us, first start to "
                  f"last end {prof['span_ms'] * 1e3:.1f} us per replay")
            for name, us, n in prof["kernels"]:
                print(f"  {us:8.2f} us  x{n:<4.1f} {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), bandwidth=bw, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

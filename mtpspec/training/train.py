"""Train a small GLM-4.5-style (default) or GLM-5-architecture (``--arch glm_moe_dsa``) model with
one MTP layer on GSM8K + generated word problems.

``python -m mtpspec.training.train --output-dir out/demo`` (or ``mtpspec train``); ``--tiny`` trains a
much smaller model on the CPU in a few minutes. Steps:

1. read GSM8K train (``--gsm8k-dir`` file or folder, else ``$MTPSPEC_GSM8K_DIR``, else the copy in
   :mod:`mtpspec.data.gsm8k`; the last ``--holdout`` rows are held out for
   validation and never trained on), generate ``--num-synthetic`` word problems (seeded);
2. train the byte-level BPE tokenizer (vocabulary not a multiple of 8, ``<|endoftext|>``);
3. build documents (single examples and 5-shot chains, each ending in ``<|endoftext|>``),
   tokenise, and batch them by length (one document per row, positions from 0);
4. train mtpspec's own ``Glm4MoeForCausalLM`` + ``Glm4MoeMTP`` (``--arch glm4_moe``, the default) or
   ``GlmMoeDsaForCausalLM`` + ``GlmMoeDsaMTP`` (``--arch glm_moe_dsa``: MLA, the DSA lightning
   indexer, DeepSeek MoE with expert groups; presets in :mod:`mtpspec.training.model_setup`) at
   tp 1 with ``L = L_main + lambda * L_MTP`` (DeepSeek-V3 eq. 25), AdamW with fp32 master weights,
   bf16 compute on CUDA (fp32 on CPU), warm-up + cosine LR over steps or over the time budget,
   auxiliary-loss-free router balancing; for ``glm_moe_dsa`` the attention runs dense for the first
   ``--indexer-warmup-fraction`` of the budget and sparse (each query attends its indexer's top
   ``index_topk``) after it, and the indexers learn from the KL objective of DeepSeek-V3.2
   (:mod:`mtpspec.training.dsa`), weighted by ``--indexer-kl-weight``;
   ``--init-from DIR`` starts from a saved model (its config and tokenizer; step 2 is skipped) and
   ``--freeze-target`` then trains only the MTP layers (the target stays bit-identical), which
   is how to retrain the MTP layers of an existing model; ``--mtp-distill alpha`` mixes
   self-distillation towards the target's own next-position distribution into the MTP loss
   (``mtp_loss`` module docstring); ``--distill-fraction f`` ends the run with a phase 2 of
   that share of the budget in which the target is frozen and the MTP layers are distilled
   (for ``glm_moe_dsa`` with sparse attention, the MTP layer's own indexer still learning from its
   KL); retraining the MTP layer of a trained ``glm_moe_dsa`` model takes
   ``--indexer-warmup-fraction 0`` (sparse attention throughout, as the target was trained);
   ``--self-distill-prompts N`` has the target, when it freezes (at the start with
   ``--freeze-target`` and ``--init-from``, else when phase 2 begins, inside the time budget and
   before phase 2's learning-rate schedule starts), write greedy
   completions of N GSM8K train questions in ``mtpspec eval gsm8k``'s 5-shot prompt
   (:mod:`mtpspec.training.self_distill`), then of ``--self-distill-synthetic M`` generated
   problems (stream ``seed + SELF_DISTILL_STREAM`` of the corpus generator, questions in the same
   5-shot prompt: more completions than GSM8K's 7k train questions give, so the MTP layer sees
   fewer repeats), and draws ``--self-distill-share`` of the batches from
   then on from those documents; the MTP layers' agreement on the held-out rows' own completions
   is logged as ``val_self``;
5. stop at ``--max-steps`` or when ``--max-minutes`` (wall clock of the whole run) is nearly
   used, then write ``config.json``, ``model.safetensors`` (bf16, Hugging Face layout; tied
   ``lm_head`` and MTP ``shared_head.head`` are omitted, the loader ties them) and
   ``tokenizer.json``, plus ``train_log.jsonl`` (one JSON record per logged step and
   validation) and ``summary.json``. ``--max-steps 0``: no step limit (``--max-minutes`` then
   ends the run). With ``--overwrite-output-dir`` the folder's earlier model files (its own
   ``config.json``, weights, tokenizer, logs; nothing else) are removed only once the data, the
   starting model and any self-distillation documents are ready. Ctrl-C / SIGTERM in the loop:
   the model trained so far is saved, the final checks skipped, exit status 130.

The GLM-5-architecture recipe (9 minutes on one H200, the defaults otherwise):
``mtpspec train --arch glm_moe_dsa --output-dir out/glm_moe_dsa_demo``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from mtpspec.training import corpus as corpus_mod
from mtpspec.data.gsm8k import format_query, load_gsm8k, resolve_gsm8k, training_document


@dataclass
class TrainConfig:
    """Every knob of the recipe (the CLI flags mirror these names)."""

    output_dir: str = "out/demo_model"
    preset: str = "demo"
    arch: str = "glm4_moe"                  # glm4_moe | glm_moe_dsa (model_setup.ARCHS)
    index_topk: int = 0                     # glm_moe_dsa: the DSA selection size; 0 = the preset's (demo: 256)
    indexer_warmup_fraction: float = 0.25   # glm_moe_dsa: share of the budget trained with dense attention
    indexer_kl_weight: float = 1.0          # glm_moe_dsa: weight of the indexers' KL (training/dsa.py) in the loss
    indexer_kl_row_stride: int = 8          # glm_moe_dsa: the KL over every n-th query row (training/dsa.py, point 5)
    gsm8k_dir: str = ""
    gsm8k_limit: int = 0
    holdout: int = 256
    vocab_size: int = 10_007
    tokenizer_synthetic: int = 20_000
    num_synthetic: int = 1_000_000
    gsm8k_epochs: int = 12
    single_prob: float = 0.6
    num_shots: int = 5
    max_len: int = 2048
    tokens_per_batch: int = 65_536
    max_steps: int = 1_000_000
    max_minutes: float = 9.0
    reserve_seconds: float = 20.0
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    mtp_lambda: float = 0.6
    mtp_depth: int = 3
    mtp_distill: float = 0.0
    init_from: str = ""
    freeze_target: bool = False
    distill_fraction: float = 0.33
    distill_lr: float = 5e-4
    distill_warmup_steps: int = 50
    distill_depth: int = 1
    self_distill_prompts: int = 0           # > 0: the frozen target's greedy completions of this many GSM8K
                                            # train questions
    self_distill_synthetic: int = 0         # and of this many generated problems (after those), same prompt
    self_distill_share: float = 0.5         # share of the frozen-target batches drawn from those documents
    self_distill_max_tokens: int = 256      # completion length limit (eval gsm8k's default)
    self_distill_seconds: float = 150.0     # generation time budget (wall clock, inside --max-minutes)
    router_bias_speed: float = 0.001
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    log_every: int = 10
    eval_every: int = 250
    eval_docs: int = 64
    accept_prompts: int = 8
    accept_max_new: int = 128
    workers: int = 0
    threads: int = 0
    save_dtype: str = "bfloat16"
    max_shard_mib: float = 15.0             # weights in shards of at most this many MiB (0 = one file)
    progress: bool = True
    overwrite_output_dir: bool = False      # allow a non-empty --output-dir (its previous model files are removed)


TINY_OVERRIDES: Dict[str, Any] = dict(
    preset="tiny", num_synthetic=10_000, tokenizer_synthetic=5_000, gsm8k_epochs=1, tokens_per_batch=2048,
    max_minutes=4.0, reserve_seconds=30.0, lr=5e-3, warmup_steps=10, distill_warmup_steps=5, log_every=5,
    eval_every=50, eval_docs=16, accept_prompts=4, accept_max_new=48, device="cpu", dtype="float32")


def _fmt(d: Dict[str, Any]) -> str:
    r = {k: (round(x, 4) if isinstance(x, float) else [round(y, 4) for y in x] if isinstance(x, list) else x)
         for k, x in d.items()}
    return json.dumps(r)


def _log(msg: str) -> None:
    print(f"[mtpspec train] {msg}", file=sys.stderr, flush=True)


def _resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


#: ``--dtype`` (besides ``auto``) and ``--save-dtype`` names (checked by :func:`check_config`).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[cfg.dtype]


class JsonlLog:
    """Append-only JSON-lines log."""

    def __init__(self, path: str) -> None:
        self.f = open(path, "w", encoding="utf-8")

    def write(self, record: Dict[str, Any]) -> None:
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def prepare_data(cfg: TrainConfig, log=_log, tok=None):
    """Steps 1-3 of the module docstring (step 2 skipped when a tokenizer ``tok`` is given).
    Returns ``(tokenizer, train_docs, val_docs, val_rows, stats)``."""
    from mtpspec.training.tokenizer import eot_id, train_tokenizer
    t0 = time.time()
    rows = load_gsm8k(resolve_gsm8k("train", cfg.gsm8k_dir, "--gsm8k-dir"))
    if cfg.gsm8k_limit:
        rows = rows[:cfg.gsm8k_limit]
    if not 0 <= cfg.holdout < len(rows):
        raise ValueError(f"--holdout must be in [0, {len(rows)}), got {cfg.holdout}")
    train_rows, val_rows = rows[:len(rows) - cfg.holdout], rows[len(rows) - cfg.holdout:]
    workers = cfg.workers or min(16, os.cpu_count() or 1)
    synthetic = corpus_mod.generate_examples(cfg.num_synthetic, cfg.seed, workers)
    t1 = time.time()
    if tok is None:
        tok_texts = [training_document([r]) for r in train_rows]
        tok_texts += [training_document([e]) for e in synthetic[:cfg.tokenizer_synthetic]]
        tok = train_tokenizer(tok_texts, cfg.vocab_size)
    t2 = time.time()
    plan = corpus_mod.CorpusPlan(train_rows, synthetic, cfg.gsm8k_epochs, cfg.single_prob, cfg.num_shots,
                                 cfg.seed, cfg.max_len)
    docs, src = plan.documents()
    train_docs = corpus_mod.tokenize_documents(tok, docs, src, cfg.max_len)
    if not len(train_docs):
        raise ValueError(f"no training document fits --max-len {cfg.max_len} tokens (a GSM8K solution takes about "
                         "100-300); raise --max-len")
    vrng = random.Random(cfg.seed + 7)
    val_texts = corpus_mod.chain_documents(val_rows, vrng, cfg.single_prob, cfg.num_shots)[:cfg.eval_docs]
    val_docs = corpus_mod.tokenize_documents(tok, val_texts, [0] * len(val_texts), cfg.max_len)
    t3 = time.time()
    lengths = train_docs.lengths
    g_tokens = int(lengths[train_docs.source == 0].sum())
    stats = {
        "gsm8k_train_rows": len(train_rows), "gsm8k_holdout_rows": len(val_rows), "synthetic_problems": len(synthetic),
        "vocab_size": tok.get_vocab_size(), "eot_id": eot_id(tok), "train_documents": len(train_docs),
        "train_tokens": int(lengths.sum()), "gsm8k_tokens": g_tokens, "synthetic_tokens": int(lengths.sum()) - g_tokens,
        "dropped_documents": train_docs.dropped, "max_document_tokens": int(lengths.max()),
        "seconds_generate": round(t1 - t0, 2), "seconds_tokenizer": round(t2 - t1, 2),
        "seconds_tokenize": round(t3 - t2, 2)}
    log(f"data: {stats}")
    return tok, train_docs, val_docs, val_rows, stats


def _val_batches(val_docs, pad_id: int, max_len: int, budget: int):
    import numpy as np
    from mtpspec.training.packing import bucket_batches, make_batch
    rng = np.random.default_rng(0)
    return [make_batch(val_docs, idx, pad_id, max_len) for idx in bucket_batches(val_docs.lengths, budget, max_len, rng)]


def save_model(out_dir: str, target, mtp, config_dict: Dict[str, Any], tok, save_dtype: torch.dtype,
               max_shard_mib: float = 0.0) -> List[str]:
    """Write ``config.json``, safetensors weights (Hugging Face layout; shards of at most
    ``max_shard_mib`` MiB with an index when larger, 0 = one file) and ``tokenizer.json``."""
    from mtpspec.models import export_hf_state_dict, save_checkpoint
    from mtpspec.training.tokenizer import save_tokenizer
    tensors = export_hf_state_dict(target, mtp, dtype=save_dtype)
    # The router's correction bias is fp32 in mtpspec and Hugging Face alike; keep it so.
    for k in tensors:
        if k.endswith(("e_score_correction_bias", "mlp.gate.weight")):
            tensors[k] = tensors[k].float()
    # So is the DSA indexer's weights_proj (mtpspec keeps it in fp32; its output decides the selection).
    for k in tensors:
        if k.endswith("indexer.weights_proj.weight"):
            tensors[k] = tensors[k].float()
    raw = dict(config_dict)
    raw["torch_dtype"] = str(save_dtype).replace("torch.", "")
    written = save_checkpoint(out_dir, tensors, raw,
                              max_shard_bytes=int(max_shard_mib * 2**20) if max_shard_mib > 0 else None)
    save_tokenizer(tok, out_dir)
    return written + ["tokenizer.json"]


@dataclass
class _Phase:
    """One training phase: its LR schedule (warm-up + cosine over the phase's own steps or time,
    whichever ends first), MTP depth and distillation weight."""

    lr: float
    warmup_steps: int
    depth: int
    alpha: float
    start_step: int
    start_time: float
    end_step: int
    end_time: float

    def lr_at(self, step: int, now: float, min_lr_ratio: float) -> float:
        from mtpspec.training.optim import lr_at
        progress = max((step - self.start_step) / max(self.end_step - self.start_step, 1),
                       (now - self.start_time) / max(self.end_time - self.start_time, 1e-6))
        return lr_at(step - self.start_step, progress, self.lr, self.warmup_steps, min_lr_ratio)


def _freeze(target: torch.nn.Module) -> None:
    """Target frozen: only the MTP layers' own parameters train (the shared embedding / head are
    the target's and stay bit-identical)."""
    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()


def _start_distill_phase(target, mtp, opt, balancer, cfg: TrainConfig):
    """Phase 2 of a ``distill_fraction`` run: freeze the target, stop its router updates, and
    return a fresh AdamW over the MTP layers' own parameters (fp32 masters carried over)."""
    from mtpspec.training.optim import MasterWeightAdamW
    _freeze(target)
    balancer.restrict_to([mtp.model])
    frozen = {id(p) for p in target.parameters()}
    params = [p for p in {id(p): p for p in mtp.parameters()}.values() if p.requires_grad and id(p) not in frozen]
    old_masters = {id(p): m for p, m in opt.pairs}
    new = MasterWeightAdamW(params, cfg.distill_lr, (cfg.beta1, cfg.beta2), cfg.weight_decay)
    with torch.no_grad():
        for p, m in new.pairs:
            if m is not p:
                m.copy_(old_masters[id(p)])
    return new


def load_initial_model(path: str, device: torch.device, dtype: torch.dtype, max_len: Optional[int] = None):
    """``--init-from``: ``(target, mtp, config_dict, tokenizer)`` of an mtpspec / Hugging Face
    checkpoint folder (``config.json``, safetensors, ``tokenizer.json``), trainable, at tp 1.

    Raises:
        FileNotFoundError: no ``config.json`` or ``tokenizer.json`` in ``path``.
        ValueError: ``max_len`` (``--max-len``, the longest training document) above the model's
            ``max_position_embeddings`` (its rotary table ends there), before anything is loaded.
        CheckpointError (and subclasses): weights that do not load (see ``load_models``).
    """
    from mtpspec.models import load_models
    from mtpspec.training.tokenizer import load_tokenizer
    for name in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(path, name)):
            raise FileNotFoundError(f"--init-from {path}: no {name} there (expected a model folder with config.json, "
                                    "safetensors weights and tokenizer.json)")
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config_dict = json.load(f)
    positions = config_dict.get("max_position_embeddings")
    if max_len is not None and isinstance(positions, int) and max_len > positions:
        raise ValueError(f"--max-len {max_len} exceeds the max_position_embeddings {positions} of --init-from {path} "
                         f"(training documents would run past its rotary table); pass --max-len {positions} or less")
    target, mtp = load_models(path, dtype=dtype, device=device)
    for m in (target, mtp):
        for p in m.parameters():
            p.requires_grad_(True)
        m.train()
    return target, mtp, config_dict, load_tokenizer(os.path.join(path, "tokenizer.json"))


def _check_paths(cfg: TrainConfig) -> None:
    """The part of :func:`check_config` that reads the file system (after the value checks)."""
    if cfg.init_from:
        cfg_path = os.path.join(cfg.init_from, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"--init-from {cfg.init_from!r}: expected a saved model folder (config.json, "
                             "safetensors weights, tokenizer.json); there is no config.json")
        model_type = _model_type(cfg_path)
        if model_type != cfg.arch:
            from mtpspec.training.model_setup import ARCHS
            fix = f"pass --arch {model_type}" if model_type in ARCHS else f"train continues {' / '.join(sorted(ARCHS))}"
            raise ValueError(f"--init-from {cfg.init_from} holds a {model_type!r} model; {fix} (got --arch {cfg.arch})")
    if cfg.gsm8k_dir and os.path.basename(os.path.normpath(cfg.gsm8k_dir)) == "test.jsonl":
        raise ValueError(f"--gsm8k-dir {cfg.gsm8k_dir!r} names GSM8K's test split; training reads the train split "
                         "(train.jsonl, or a folder holding it): the test split is for evaluation only")
    if not cfg.output_dir:
        raise ValueError("--output-dir must name a folder (the trained model is written there), got ''")
    if os.path.lexists(cfg.output_dir) and not os.path.exists(cfg.output_dir):
        raise ValueError(f"--output-dir {cfg.output_dir!r} is a symbolic link to nothing; give a folder")
    if os.path.exists(cfg.output_dir) and not os.path.isdir(cfg.output_dir):
        raise ValueError(f"--output-dir {cfg.output_dir!r} is a file; give a folder (new or empty, or with "
                         "--overwrite-output-dir one holding an earlier model)")
    above = os.path.dirname(os.path.abspath(cfg.output_dir))
    while not os.path.exists(above):  # the folder is made with its parents: the nearest existing one
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise ValueError(f"--output-dir {cfg.output_dir!r} cannot be made: {above!r} is a file, not a folder")
    # (--init-from holds a config.json by now; samefile: any spelling, a link or a bind mount)
    if cfg.init_from and os.path.isdir(cfg.output_dir) and os.path.samefile(cfg.init_from, cfg.output_dir):
        raise ValueError(f"--init-from and --output-dir are the same folder ({cfg.init_from!r}): a run replaces its "
                         "output folder's model files, so it would overwrite the model it starts from; write to "
                         "another folder and move it afterwards")
    if os.path.isdir(cfg.output_dir) and os.listdir(cfg.output_dir) and not cfg.overwrite_output_dir:
        raise ValueError(f"--output-dir {cfg.output_dir!r} is not empty; pass --overwrite-output-dir to train into "
                         "it (its previous model files are removed first), or choose another folder")


def _model_type(cfg_path: str) -> Optional[str]:
    """``model_type`` of the ``config.json`` at ``cfg_path`` (``None`` when it has none).

    Raises:
        ValueError: the file cannot be read or is not a JSON object (named).
    """
    try:
        with open(cfg_path, encoding="utf-8") as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{cfg_path}: not a readable JSON object ({exc})") from None


def check_config(cfg: TrainConfig) -> None:
    """The checks that need no data or model, run before anything is built.

    Raises:
        ValueError: an unknown ``--arch``; ``--lr`` / ``--distill-lr`` <= 0, ``--mtp-distill``
            outside ``[0, 1]``, a negative ``--mtp-lambda`` / ``--max-steps`` / ``--max-minutes`` /
            ``--gsm8k-limit``, both limits 0 (no limit at all), a depth or ``--tokens-per-batch``
            below 1; an ``--output-dir`` that is empty, a file, a link to nothing, under a file, or
            ``--init-from``'s folder; ``--freeze-target`` without ``--init-from``;
            ``--index-topk`` below 0 or given for an architecture
            without an indexer (or with ``--init-from``, whose model keeps its own), a
            ``--distill-fraction`` outside ``[0, 1)``; for ``glm_moe_dsa`` an
            ``--indexer-warmup-fraction`` outside ``[0, 1 - distill_fraction]`` or a negative
            ``--indexer-kl-weight`` (the other architectures ignore both); ``--self-distill-prompts``
            / ``--self-distill-synthetic`` without a frozen target (``--freeze-target`` or
            ``--distill-fraction > 0``); ``--log-every`` below 1,
            ``--eval-every`` below 0, a ``--max-minutes`` budget no longer than ``--reserve-seconds``
            (nothing would train), an unknown ``--dtype`` / ``--save-dtype``, an ``--init-from``
            folder without ``config.json`` or of another architecture than ``--arch``, a
            ``--gsm8k-dir`` naming the test split, a non-empty ``--output-dir`` without
            ``--overwrite-output-dir``; a ``--device`` this torch cannot use, ``--max-len`` below 2,
            an unknown ``--preset`` for a new model, a ``--self-distill-share`` outside ``[0, 1]``.
    """
    _check_values(cfg)
    _check_paths(cfg)


def _check_values(cfg: TrainConfig) -> None:
    from mtpspec.training.model_setup import ARCHS
    if cfg.arch not in ARCHS:
        raise ValueError(f"--arch must be one of {sorted(ARCHS)}, got {cfg.arch!r}")
    if cfg.log_every < 1 or cfg.eval_every < 0:
        raise ValueError(f"--log-every must be >= 1 and --eval-every >= 0 (0: off), got {cfg.log_every}, "
                         f"{cfg.eval_every}")
    if cfg.max_minutes > 0 and cfg.max_minutes * 60.0 <= cfg.reserve_seconds:
        raise ValueError(f"--max-minutes {cfg.max_minutes:g} ({cfg.max_minutes * 60:g} s) leaves no training time "
                         f"after --reserve-seconds {cfg.reserve_seconds:g} (kept for saving and the final checks)")
    if cfg.dtype != "auto" and cfg.dtype not in DTYPES:
        raise ValueError(f"--dtype must be auto, {', '.join(DTYPES)}, got {cfg.dtype!r}")
    if cfg.save_dtype not in DTYPES:
        raise ValueError(f"--save-dtype must be one of {', '.join(DTYPES)}, got {cfg.save_dtype!r}")
    for flag, value, ok, want in (
            ("--lr", cfg.lr, cfg.lr > 0, "> 0"), ("--distill-lr", cfg.distill_lr, cfg.distill_lr > 0, "> 0"),
            ("--mtp-distill", cfg.mtp_distill, 0.0 <= cfg.mtp_distill <= 1.0, "in [0, 1]"),
            ("--mtp-lambda", cfg.mtp_lambda, cfg.mtp_lambda >= 0, ">= 0"),
            ("--mtp-depth", cfg.mtp_depth, cfg.mtp_depth >= 1, ">= 1"),
            ("--distill-depth", cfg.distill_depth, cfg.distill_depth >= 1, ">= 1"),
            ("--tokens-per-batch", cfg.tokens_per_batch, cfg.tokens_per_batch > 0, "> 0"),
            ("--max-steps", cfg.max_steps, cfg.max_steps >= 0, ">= 0 (0: no limit)"),
            ("--max-minutes", cfg.max_minutes, 0 <= cfg.max_minutes < float("inf"), "finite and >= 0 (0: no limit)"),
            ("--gsm8k-limit", cfg.gsm8k_limit, cfg.gsm8k_limit >= 0, ">= 0 (0: every row)"),
            ("--reserve-seconds", cfg.reserve_seconds, 0 <= cfg.reserve_seconds < float("inf"), "finite and >= 0")):
        if not ok:  # also catches nan
            raise ValueError(f"{flag} must be {want}, got {value}")
    if cfg.max_steps == 0 and cfg.max_minutes == 0:
        raise ValueError("--max-steps 0 and --max-minutes 0 set no limit at all: training would never stop; give "
                         "a step count, a time budget, or both")
    if cfg.freeze_target and not cfg.init_from:
        raise ValueError("--freeze-target needs --init-from: it keeps a trained target fixed, and a new model's "
                         "target would stay random")
    if not 0.0 <= cfg.distill_fraction < 1.0:
        raise ValueError(f"--distill-fraction must be in [0, 1), got {cfg.distill_fraction}")
    if cfg.index_topk < 0:
        raise ValueError(f"--index-topk must be >= 0 (0: the preset's), got {cfg.index_topk}")
    if cfg.index_topk and cfg.arch != "glm_moe_dsa":
        raise ValueError(f"--index-topk applies to --arch glm_moe_dsa (a DSA indexer), not {cfg.arch}")
    if cfg.index_topk and cfg.init_from:
        raise ValueError("--index-topk sets a new model's selection size; an --init-from model keeps its own")
    if cfg.device != "auto":  # before the data stage builds anything
        try:
            dev = torch.device(cfg.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"--device must be auto, cpu, cuda, cuda:N or another torch device, got "
                             f"{cfg.device!r}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {cfg.device}: this torch ({torch.__version__}) sees no CUDA GPU; use cpu")
    if cfg.max_len < 2:
        raise ValueError(f"--max-len must be >= 2 (the longest training document, in tokens), got {cfg.max_len}")
    if not cfg.init_from:  # a new model: its preset must exist (an --init-from model brings its own)
        if cfg.preset not in ARCHS[cfg.arch][0]:
            raise ValueError(f"--preset must be one of {sorted(ARCHS[cfg.arch][0])} for --arch {cfg.arch}, "
                             f"got {cfg.preset!r}")
    if not 0.0 <= cfg.self_distill_share <= 1.0:
        raise ValueError(f"--self-distill-share must be in [0, 1], got {cfg.self_distill_share}")
    if cfg.self_distill_prompts < 0 or cfg.self_distill_synthetic < 0:
        raise ValueError(f"--self-distill-prompts and --self-distill-synthetic must be >= 0, got "
                         f"{cfg.self_distill_prompts}, {cfg.self_distill_synthetic}")
    if _self_distill_on(cfg):
        if not (cfg.freeze_target or cfg.distill_fraction > 0):
            raise ValueError("--self-distill-prompts / --self-distill-synthetic train only where the target is "
                             "frozen: pass --freeze-target or --distill-fraction > 0 (a target trained on its own "
                             "outputs would learn nothing new)")
        if cfg.self_distill_max_tokens < 1 or not cfg.self_distill_seconds > 0:
            raise ValueError(f"--self-distill-max-tokens must be >= 1 and --self-distill-seconds > 0, got "
                             f"{cfg.self_distill_max_tokens}, {cfg.self_distill_seconds}")
    if cfg.arch != "glm_moe_dsa":
        return  # the indexer flags below mean nothing to the other architectures
    if not 0.0 <= cfg.indexer_warmup_fraction <= 1.0 - cfg.distill_fraction:
        raise ValueError(f"--indexer-warmup-fraction must be in [0, 1 - distill_fraction = "
                         f"{1.0 - cfg.distill_fraction:g}] (the dense warm-up lies inside phase 1), got "
                         f"{cfg.indexer_warmup_fraction}")
    if not cfg.indexer_kl_weight >= 0:
        raise ValueError(f"--indexer-kl-weight must be >= 0, got {cfg.indexer_kl_weight}")
    if cfg.indexer_kl_row_stride < 1:
        raise ValueError(f"--indexer-kl-row-stride must be >= 1, got {cfg.indexer_kl_row_stride}")


def _val_self(target, mtp, val_self, device, cfg: TrainConfig, dsa, jlog, step: int, tokens: int, log) -> Dict[str, float]:
    """Validation on the held-out rows' own greedy completions (``val_self`` records): the draft
    agreement there is the nearest proxy of the evaluation's acceptance rate. {} without them."""
    if not val_self:
        return {}
    from mtpspec.training.quick_eval import validation_metrics
    v = validation_metrics(target, mtp, val_self, device, cfg.mtp_lambda, cfg.mtp_depth, dsa=dsa)
    jlog.write({"kind": "val_self", "step": step, "tokens": tokens, **v})
    log(f"step {step} val_self {_fmt(v)}")
    return v


#: ``--self-distill-synthetic``'s problems come from generator stream ``seed + SELF_DISTILL_STREAM``,
#: not the stream ``seed`` the training corpus draws from.
SELF_DISTILL_STREAM = 1_000_003


def _self_distill_on(cfg: TrainConfig) -> bool:
    """Whether the run writes self-distillation documents (``--self-distill-prompts`` or
    ``--self-distill-synthetic``)."""
    return cfg.self_distill_prompts > 0 or cfg.self_distill_synthetic > 0


def self_distill_data(cfg: TrainConfig, device: torch.device, log=_log, model_dir: str = ""):
    """``--self-distill-prompts``: the greedy completions of the model in ``model_dir`` (default
    ``--init-from``) of the first ``eval_docs`` held-out rows and of GSM8K train questions (the
    rows ``prepare_data`` trains on, after the shots), each in ``mtpspec eval gsm8k``'s 5-shot
    prompt, then of ``self_distill_synthetic`` generated problems (stream ``seed +
    SELF_DISTILL_STREAM``) in the same prompt, as ``(train_docs, val_docs, stats)``
    (:mod:`mtpspec.training.self_distill`). One engine writes them all, the held-out prompts in
    its first wave (always complete), then the train questions, then the generated ones, until
    ``self_distill_seconds`` of generation are used (checked between waves).

    Raises:
        FileNotFoundError / ValueError: as ``resolve_gsm8k`` / ``load_gsm8k``; ValueError from
            ``LLM`` for a model it cannot serve (see :class:`mtpspec.LLM`).
    """
    from mtpspec.entrypoints.eval_gsm8k import DEFAULT_NUM_FEWSHOT as EVAL_NUM_FEWSHOT, build_prompts
    from mtpspec.training.self_distill import docs_from_token_lists, generate_documents, self_distill_prompts
    rows = load_gsm8k(resolve_gsm8k("train", cfg.gsm8k_dir, "--gsm8k-dir"))
    if cfg.gsm8k_limit:
        rows = rows[:cfg.gsm8k_limit]
    train_rows, val_rows = rows[:len(rows) - cfg.holdout], rows[len(rows) - cfg.holdout:]
    prompts = self_distill_prompts(train_rows, EVAL_NUM_FEWSHOT)[:cfg.self_distill_prompts]
    n_gsm8k = len(prompts)
    if cfg.self_distill_synthetic:
        generated = corpus_mod.generate_examples(cfg.self_distill_synthetic, cfg.seed + SELF_DISTILL_STREAM)
        prompts += build_prompts(generated, train_rows, EVAL_NUM_FEWSHOT)
    val_prompts = build_prompts(val_rows[:cfg.eval_docs], train_rows, EVAL_NUM_FEWSHOT)
    kw = {"device": str(device), "dtype": "bfloat16" if device.type == "cuda" else "float32",
          "max_num_seqs": 256 if device.type == "cuda" else 16,
          "gpu_memory_utilization": 0.5, "speculative_config": {"num_speculative_tokens": 3}}
    seqs, lens, stats = generate_documents(model_dir or cfg.init_from, val_prompts + prompts,
                                           cfg.self_distill_max_tokens, cfg.self_distill_seconds, kw,
                                           wave=max(1024, len(val_prompts)), log=log)
    nv = len(val_prompts)
    train_docs = docs_from_token_lists(seqs[nv:], cfg.max_len, lens[nv:])
    val_docs = docs_from_token_lists(seqs[:nv], cfg.max_len, lens[:nv])
    done = len(seqs) - nv  # train prompts completed, in order: the GSM8K questions, then the generated ones
    stats = {**stats, "held_out_prompts": nv, "gsm8k_prompts_done": min(done, n_gsm8k),
             "gsm8k_prompts_offered": n_gsm8k, "generated_prompts_done": max(0, done - n_gsm8k),
             "generated_prompts_offered": cfg.self_distill_synthetic, "documents": len(train_docs),
             "dropped": train_docs.dropped, "val_documents": len(val_docs)}
    log(f"self-distillation data: {stats}")
    if done < len(prompts):
        log(f"warning: --self-distill-seconds {cfg.self_distill_seconds:g} ran out after {done} of {len(prompts)} "
            f"prompts ({stats['generated_prompts_done']} of {cfg.self_distill_synthetic} generated ones)")
    return train_docs, val_docs, stats


#: What a previous run (or another model) left in ``--output-dir`` that would be read with the new
#: model: removed before training starts, so an interrupted run never leaves old weights behind
#: its new log (and a stale generation_config.json never gives the new model EOS ids or defaults).
_MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "model.safetensors.index.json", "summary.json", "train_log.jsonl")


#: The weight files :func:`~mtpspec.models.save_checkpoint` writes (one file, or shards); other
#: ``.safetensors`` files in the folder are the user's and stay.
_WEIGHT_FILE = re.compile(r"model(-\d+-of-\d+)?\.safetensors")


def _clear_previous_model(folder: str) -> None:
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        if name in _MODEL_FILES or _WEIGHT_FILE.fullmatch(name):
            os.remove(os.path.join(folder, name))


def train(cfg: TrainConfig, log=_log, stage: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Run the recipe (module docstring); returns the summary dict (also written to summary.json).
    SIGTERM (``timeout``, ``kill``, a scheduler's pre-emption) stops training as Ctrl-C does: the
    model trained so far is saved, ``stop_reason`` ``"interrupted"`` (the final checks skipped).
    ``stage``: a dict the run keeps its progress in (``"stage"``: ``"prepare"`` / ``"cleared"`` /
    ``"saved"``, see :func:`_train`), for a caller that catches an interrupt outside the loop."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return _train(cfg, log, stage)

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return _train(cfg, log, stage)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _train(cfg: TrainConfig, log=_log, stage: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """The recipe (:func:`train`). ``stage["stage"]`` tells an interrupted caller how far it got:
    ``"prepare"`` (``--output-dir`` untouched), ``"cleared"`` (its earlier model files removed, the
    new model not saved yet), ``"saved"`` (the model written; the final checks and summary.json
    may be missing)."""
    stage = {} if stage is None else stage
    stage["stage"] = "prepare"
    from mtpspec.config import ModelConfig
    from mtpspec.training.model_setup import build_models, count_parameters, make_config_dict
    from mtpspec.training.optim import MasterWeightAdamW, RouterBalancer
    from mtpspec.training.packing import iterate_batches, pad_fraction
    from mtpspec.training.quick_eval import acceptance_summary, validation_metrics
    from mtpspec.training.step import forward_loss
    from mtpspec.training.tokenizer import eot_id

    check_config(cfg)
    start = time.time()
    deadline = start + cfg.max_minutes * 60.0 if cfg.max_minutes > 0 else float("inf")
    torch.manual_seed(cfg.seed)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    device = _resolve_device(cfg)
    dtype = _resolve_dtype(cfg, device)
    save_dtype = DTYPES[cfg.save_dtype]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # the starting model and the data first: a bad input found there leaves --output-dir as it was
    if cfg.init_from:
        target, mtp, config_dict, tok = load_initial_model(cfg.init_from, device, dtype, cfg.max_len)
        tok, train_docs, val_docs, val_rows, data_stats = prepare_data(cfg, log, tok=tok)
    else:
        tok, train_docs, val_docs, val_rows, data_stats = prepare_data(cfg, log)
        extra = {"index_topk": cfg.index_topk} if cfg.index_topk else {}
        config_dict = make_config_dict(cfg.preset, tok.get_vocab_size(), eot_id(tok), arch=cfg.arch,
                                       max_position_embeddings=max(4096, cfg.max_len), **extra)
        target, mtp = build_models(ModelConfig.from_dict(config_dict), device, dtype, seed=cfg.seed)
    dsa = None
    if cfg.arch == "glm_moe_dsa":
        from mtpspec.training.dsa import DsaTraining
        dsa = DsaTraining([target, mtp], "dense" if cfg.indexer_warmup_fraction > 0 else "sparse",
                          cfg.indexer_kl_weight, cfg.indexer_kl_row_stride)
    eot = eot_id(tok)
    n_params = count_parameters(target, mtp)
    log(f"model: {cfg.init_from or cfg.arch + ' preset ' + cfg.preset}, {n_params}, device {device}, dtype {dtype}"
        f"{', target frozen' if cfg.freeze_target else ''}")

    if cfg.freeze_target:
        _freeze(target)
    unique = list({id(p): p for p in list(target.parameters()) + list(mtp.parameters())}.values())
    balancer = RouterBalancer([mtp.model] if cfg.freeze_target else [target, mtp.model], cfg.router_bias_speed)
    trainable = [p for p in unique if p.requires_grad]
    opt = MasterWeightAdamW(trainable, cfg.lr, (cfg.beta1, cfg.beta2), cfg.weight_decay)
    phase2: Dict[str, Any] = {}

    batches = iterate_batches(train_docs, cfg.tokens_per_batch, cfg.max_len, eot, cfg.seed)
    val_batches = _val_batches(val_docs, eot, cfg.max_len, cfg.tokens_per_batch)
    frozen_batches, val_self, sd_stats = batches, [], {}

    def self_distill_setup(model_dir: str = "") -> None:
        """The frozen target's own completions (``self_distill_data``) mixed into the batches."""
        nonlocal frozen_batches, val_self, sd_stats
        from mtpspec.training.self_distill import MixedBatches
        sd_docs, sd_val, sd_stats = self_distill_data(cfg, device, log, model_dir)
        if len(sd_docs):
            frozen_batches = MixedBatches(batches, iterate_batches(sd_docs, cfg.tokens_per_batch, cfg.max_len, eot,
                                                                   cfg.seed), cfg.self_distill_share, cfg.seed)
        val_self = _val_batches(sd_val, eot, cfg.max_len, cfg.tokens_per_batch) if len(sd_val) else []

    if _self_distill_on(cfg) and cfg.freeze_target:  # frozen from the start: the --init-from weights
        self_distill_setup()
    # everything read and built: only now the earlier model in --output-dir goes
    _clear_previous_model(cfg.output_dir)
    os.makedirs(cfg.output_dir, exist_ok=True)
    stage["stage"] = "cleared"
    pads = pad_fraction(train_docs, cfg.tokens_per_batch, cfg.max_len)
    log_path = os.path.join(cfg.output_dir, "train_log.jsonl")
    jlog = JsonlLog(log_path)
    train_start = time.time()
    train_deadline = deadline - cfg.reserve_seconds
    train_budget = max(train_deadline - train_start, 1e-6)
    max_steps = cfg.max_steps or sys.maxsize  # 0: no step limit (check_config then demands --max-minutes)
    # Phase 1 takes the first (1 - distill_fraction) of the steps or time; phase 2 (the MTP layers
    # only, distilled) the rest.
    phase = _Phase(cfg.lr, cfg.warmup_steps, cfg.mtp_depth, cfg.mtp_distill, 0, train_start,
                   round((1.0 - cfg.distill_fraction) * max_steps),
                   train_start + (1.0 - cfg.distill_fraction) * train_budget)
    phase_no = 1
    # DSA: dense attention (indexer warm-up) for the first indexer_warmup_fraction of the steps or
    # time, whichever ends first, sparse after it (mtpspec.training.dsa).
    dsa_info: Dict[str, Any] = {}
    if dsa is not None:
        dsa_info = {"index_topk": int(config_dict["index_topk"]), "warmup_fraction": cfg.indexer_warmup_fraction,
                    "kl_weight": cfg.indexer_kl_weight, "kl_row_stride": cfg.indexer_kl_row_stride,
                    "sparse_start": None}
    warm_end_step = round(cfg.indexer_warmup_fraction * max_steps)
    warm_end_time = train_start + cfg.indexer_warmup_fraction * train_budget
    bar = None
    if cfg.progress:
        from tqdm import tqdm
        timed = cfg.max_minutes > 0
        bar = tqdm(total=int(train_budget) if timed else cfg.max_steps, unit="s" if timed else "step",
                   desc="train", dynamic_ncols=True, file=sys.stderr)
    step = tokens = 0
    history: List[Dict[str, Any]] = []
    stop_reason = "max_steps"
    last_bar = 0
    v: Dict[str, float] = {}
    vs = _val_self(target, mtp, val_self, device, cfg, dsa, jlog, 0, 0, log)  # the starting point
    try:
        while step < max_steps:
            now = time.time()
            if now >= train_deadline:
                stop_reason = "time_budget"
                break
            if dsa is not None and dsa.mode == "dense" and (now >= warm_end_time or step >= warm_end_step):
                dsa.set_mode("sparse")
                dsa_info["sparse_start"] = {"step": step, "tokens": tokens, "train_s": round(now - train_start, 1)}
                jlog.write({"kind": "dsa", "mode": "sparse", "step": step, "tokens": tokens,
                            "elapsed_s": round(now - start, 2)})
                log(f"step {step}: DSA sparse attention (top {dsa_info['index_topk']}), indexer KL over the selection")
            phase_over = now >= phase.end_time or step >= phase.end_step
            if phase_no == 1 and cfg.distill_fraction > 0 and phase_over:
                phase_no = 2
                opt = _start_distill_phase(target, mtp, opt, balancer, cfg)
                if _self_distill_on(cfg) and not cfg.freeze_target:  # the target as phase 1 left it
                    with tempfile.TemporaryDirectory() as tmp:
                        save_model(tmp, target, mtp, config_dict, tok, save_dtype)
                        self_distill_setup(tmp)
                    vs = _val_self(target, mtp, val_self, device, cfg, dsa, jlog, step, tokens, log)
                    now = time.time()  # phase 2's schedule starts after the generation
                    if now >= train_deadline:
                        log("warning: the self-distillation documents took the rest of the time budget; phase 2 "
                            "gets no steps (raise --max-minutes or lower --self-distill-seconds)")
                phase = _Phase(cfg.distill_lr, cfg.distill_warmup_steps, cfg.distill_depth, 1.0, step, now,
                               max_steps, train_deadline)
                phase2 = {"start_step": step, "start_tokens": tokens, "start_train_s": round(now - train_start, 1)}
                jlog.write({"kind": "phase", "phase": 2, "step": step, "tokens": tokens,
                            "elapsed_s": round(now - start, 2)})
                log(f"step {step}: phase 2, target frozen, MTP layers distilled at depth {phase.depth}")
            lr = phase.lr_at(step, now, cfg.min_lr_ratio)
            opt.set_lr(lr)
            batch = next(frozen_batches if cfg.freeze_target or phase_no == 2 else batches)
            out = forward_loss(target, mtp, batch, device, cfg.mtp_lambda, mtp_depth=phase.depth,
                               mtp_distill=phase.alpha, dsa=dsa)
            out.loss.backward()
            gnorm = opt.step(cfg.grad_clip)
            opt.zero_grad()
            imbalance = balancer.step()
            step += 1
            tokens += batch.num_real_tokens
            if step % cfg.log_every == 0 or step == 1:
                rec = {"kind": "train", "phase": phase_no, "step": step, "tokens": tokens,
                       "elapsed_s": round(time.time() - start, 2),
                       "lr": lr, "loss": out.loss.item(), "target_loss": out.target_loss.item(),
                       "mtp_loss": [x.item() for x in out.mtp_losses], "grad_norm": gnorm,
                       "router_max_load": round(imbalance, 3),
                       "tokens_per_s": round(tokens / max(time.time() - train_start, 1e-9), 1)}
                if dsa is not None:
                    rec.update(dsa_mode=dsa.mode, indexer_kl=out.dsa_stats.get("indexer_kl"))
                jlog.write(rec)
                history.append(rec)
                if bar is not None:
                    bar.set_postfix(loss=f"{rec['target_loss']:.3f}", mtp=f"{rec['mtp_loss'][0]:.3f}"
                                    if rec["mtp_loss"] else "-", tok_s=f"{rec['tokens_per_s']:.0f}")
            if cfg.eval_every and step % cfg.eval_every == 0 and val_batches:
                v = validation_metrics(target, mtp, val_batches, device, cfg.mtp_lambda, cfg.mtp_depth, dsa=dsa)
                jlog.write({"kind": "val", "step": step, "tokens": tokens, **v})
                log(f"step {step} val {_fmt(v)}")
                vs = _val_self(target, mtp, val_self, device, cfg, dsa, jlog, step, tokens, log)
            if bar is not None:
                if cfg.max_minutes > 0:
                    el = int(time.time() - train_start)
                    bar.update(max(0, min(el, bar.total) - last_bar))
                    last_bar = max(last_bar, min(el, bar.total))
                else:
                    bar.update(1)
    except KeyboardInterrupt:
        stop_reason = "interrupted"
    finally:
        if bar is not None:
            bar.close()
    train_seconds = time.time() - train_start
    log(f"stopped ({stop_reason}) after {step} steps, {tokens} tokens, {train_seconds:.1f} s "
        f"({tokens / max(train_seconds, 1e-9):.0f} tokens/s)")

    written = save_model(cfg.output_dir, target, mtp, config_dict, tok, save_dtype, cfg.max_shard_mib)
    stage["stage"] = "saved"
    interrupted = stop_reason == "interrupted"  # stop soon: no final checks (a scheduler's grace period is short)
    if interrupted:
        log("interrupted: the model is saved; the final validation and acceptance estimate are skipped")
    if val_batches and not interrupted and not (cfg.eval_every and step % cfg.eval_every == 0 and step):
        final_val = validation_metrics(target, mtp, val_batches, device, cfg.mtp_lambda, cfg.mtp_depth, dsa=dsa)
        jlog.write({"kind": "val", "step": step, "tokens": tokens, **final_val})
        final_val_self = _val_self(target, mtp, val_self, device, cfg, dsa, jlog, step, tokens, log)
    else:
        final_val = v if val_batches and step else {}
        final_val_self = vs
    prompts = [tok.encode(format_query(r["question"])).ids for r in val_rows[:cfg.accept_prompts]]
    accept = {}
    # The acceptance estimate runs the layers' own (engine) forward: DSA through the indexer ops.
    with (dsa.inference() if dsa is not None else contextlib.nullcontext()):
        for k in (1, 3):
            if prompts and not interrupted and time.time() < deadline - 5:
                accept[f"k{k}"] = acceptance_summary(target, mtp, prompts, k, cfg.accept_max_new, eot, device,
                                                     deadline=deadline - 2)
    jlog.close()
    summary = {
        "config": dataclasses.asdict(cfg), "device": str(device), "device_name": (
            torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "dtype": str(dtype), "parameters": n_params, "data": data_stats, "pad_fraction": round(pads, 4),
        "steps": step, "train_tokens_seen": tokens, "train_seconds": round(train_seconds, 1),
        "tokens_per_second": round(tokens / max(train_seconds, 1e-9), 1), "stop_reason": stop_reason,
        "distill_phase": phase2, "dsa": dsa_info,
        "total_seconds": round(time.time() - start, 1), "final_val": final_val,
        "self_distill": sd_stats, "final_val_self": final_val_self,
        "acceptance_holdout_zero_shot": accept, "files": written,
        "first_logged": history[0] if history else None, "last_logged": history[-1] if history else None}
    with open(os.path.join(cfg.output_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    log(f"final val {final_val}; acceptance {json.dumps({k: round(v['acceptance_length'], 3) for k, v in accept.items()})}; "
        f"wrote {written} to {cfg.output_dir} in {summary['total_seconds']} s total")
    return summary


# ----------------------------------------------------------------------------------------- CLI
#: ``--help`` text of the flags whose meaning is not plain from the name (the module docstring has the recipe).
FLAG_HELP = {
    "arch": "glm4_moe or glm_moe_dsa (GLM-5: MLA + DSA indexer); with --init-from, that model's by default",
    "init_from": "start from this saved model (its config and tokenizer)",
    "max_minutes": "wall-clock budget of the whole run (data, training, saving); 0: no limit",
    "max_steps": "0: no limit",
    "distill_fraction": "the last share of the time in which the target is frozen and the MTP layers distilled",
    "mtp_distill": "share of the MTP loss that is distillation towards the target's next-position distribution",
    "self_distill_prompts": "write the frozen target's greedy completions of this many GSM8K train questions "
                            "(eval gsm8k's 5-shot prompt) and train the MTP layers on them",
    "self_distill_synthetic": "and of this many generated problems after them (same prompt)",
    "self_distill_share": "share of the frozen-target batches drawn from those completions",
    "self_distill_max_tokens": "completion length limit",
    "self_distill_seconds": "time budget for writing the completions (checked between waves of 1,024 prompts)",
    "indexer_warmup_fraction": "glm_moe_dsa: share of the time with dense attention while the indexers learn",
    "log_every": "steps between the records of OUTPUT_DIR/train_log.jsonl (the progress bar shows the latest)",
    "freeze_target": "train only the MTP layers (needs --init-from)",
    "overwrite_output_dir": "train into a non-empty --output-dir (the model files there are removed first)",
    "progress": "a progress bar on stderr; the per-step figures go to train_log.jsonl either way",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags for every :class:`TrainConfig` field, plus ``--tiny``."""
    p.add_argument("--tiny", action="store_true",
                   help="small model on the CPU in a few minutes (overrides defaults: " +
                   ", ".join(f"{k}={v}" for k, v in TINY_OVERRIDES.items()) +
                   ", output_dir=out/tiny_model; explicit flags still win)")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                           help=FLAG_HELP.get(f.name))
        else:
            typ = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            text = FLAG_HELP.get(f.name, "")
            p.add_argument(flag, dest=f.name, type=typ, default=None,
                           help=f"{text + '; ' if text else ''}default {f.default!r}")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then ``--tiny``'s overrides, then explicit flags; with ``--init-from`` and no
    ``--arch``, the architecture is the ``model_type`` in that folder's ``config.json``."""
    values = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    if getattr(args, "tiny", False):
        values.update(TINY_OVERRIDES)
        values["output_dir"] = "out/tiny_model"
    for f in dataclasses.fields(TrainConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    cfg_path = os.path.join(values["init_from"], "config.json") if values["init_from"] else ""
    if getattr(args, "arch", None) is None and cfg_path and os.path.isfile(cfg_path):
        model_type = _model_type(cfg_path)
        from mtpspec.training.model_setup import ARCHS
        if model_type and model_type not in ARCHS:  # not the --arch check's words: the user gave no --arch
            raise ValueError(f"--init-from {values['init_from']} holds a {model_type!r} model; mtpspec train builds "
                             f"and continues {' / '.join(sorted(ARCHS))} models only")
        if model_type:
            values["arch"] = model_type
    return TrainConfig(**values)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mtpspec.training.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    from mtpspec.entrypoints.train import run  # its error lines and exit statuses (2, 130)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""`mtpspec generate`: complete prompts with MTP speculative decoding and print the metrics.

Prompts come from ``--prompt`` (repeatable), ``--prompt-file`` (one per line) or
``--prompt-token-ids`` (comma-separated ids; for checkpoints without a tokenizer). Without
``--model`` the bundled demo model (``mtpspec.demo_model_path()``) is used when it exists.
``-k 0`` decodes without speculation. Engine flags (vLLM's spellings: ``--tensor-parallel-size``,
``--speculative-config``, ``--seed`` = engine seed, ...): :mod:`mtpspec.engine.arg_utils`;
``--sampling-seed`` gives every prompt one per-request seed.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List

from mtpspec import demo_model_path


#: The sampling fields of ``mtpspec generate`` where neither a flag nor the model's
#: generation_config.json sets them: greedy, 64 tokens.
CLI_SAMPLING_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 64}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="complete prompts with MTP speculative decoding",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled demo model, "
                                                 f"mtpspec/{os.path.basename(demo_model_path())})")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", default=None, help="a prompt (repeat for a batch)")
    src.add_argument("--prompt-file", default=None, help="file with one prompt per line")
    src.add_argument("--prompt-token-ids", action="append", default=None,
                     help="a prompt as comma-separated token ids (repeatable)")
    src.add_argument("--gsm8k-question", type=int, action="append", default=None, metavar="INDEX",
                     help="prompt with GSM8K question INDEX of --gsm8k-data as 'Question: ...\\nAnswer:' "
                          "(repeatable); stops at 'Question:' and prints the reference answer")
    p.add_argument("--gsm8k-data", default=None,
                   help="GSM8K JSONL, or a folder with test.jsonl, for --gsm8k-question (default: "
                        "$MTPSPEC_GSM8K_DIR, else the GSM8K test split bundled in mtpspec/data/gsm8k)")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    # unset: the model's generation_config.json value (--generation-config auto), else CLI_SAMPLING_DEFAULTS
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the model's generation_config.json, else 0)")
    p.add_argument("--top-p", type=float, default=None, help="default: generation_config.json's, else 1")
    p.add_argument("--top-k", type=int, default=None, help="default: generation_config.json's, else 0 (off)")
    p.add_argument("--sampling-seed", type=int, default=None,
                   help="per-request seed (SamplingParams.seed) for every prompt; default: derived from --seed")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="default: generation_config.json's max_new_tokens, else 64")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    from mtpspec.engine.arg_utils import EngineArgs
    EngineArgs.add_cli_args(p.add_argument_group("engine (vLLM's flags; mtpspec.engine.arg_utils)"), model=False)


def _usage_error(msg: str) -> None:
    """Print ``error: msg`` and exit with status 2, like every other bad input of this command."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _gsm8k_path(arg: Any) -> str:
    """The GSM8K test file: ``--gsm8k-data`` (file or folder), else ``$MTPSPEC_GSM8K_DIR``, else the
    copy bundled with the package; a path given but not found is a usage error (exit 2)."""
    from mtpspec.data.gsm8k import GSM8KNotFoundError, resolve_gsm8k
    try:
        return resolve_gsm8k("test", arg, "--gsm8k-data")
    except GSM8KNotFoundError as exc:
        _usage_error(str(exc))
        raise  # not reached: _usage_error exits


def _gsm8k_examples(args: argparse.Namespace) -> List[Dict[str, str]]:
    """The requested GSM8K test rows (``--gsm8k-question`` indices into :func:`_gsm8k_path`)."""
    from mtpspec.data.gsm8k import load_gsm8k
    path = _gsm8k_path(args.gsm8k_data)
    try:
        rows = load_gsm8k(path)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        _usage_error(f"--gsm8k-data: {exc}")
        raise  # not reached: _usage_error exits
    for i in args.gsm8k_question:
        if not 0 <= i < len(rows):
            _usage_error(f"--gsm8k-question: index {i} outside [0, {len(rows)}) of {path}")
    return [rows[i] for i in args.gsm8k_question]


def _prompts(args: argparse.Namespace) -> List[Any]:
    if args.gsm8k_question:
        from mtpspec.data.gsm8k import format_query
        return [format_query(ex["question"]) for ex in _gsm8k_examples(args)]
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                lines = [ln.rstrip("\n") for ln in f]
        except (OSError, UnicodeDecodeError) as exc:
            _usage_error(f"--prompt-file: cannot read {args.prompt_file!r}: {exc}")
        return [ln for ln in lines if ln.strip()]
    if args.prompt_token_ids:
        out = []
        for s in args.prompt_token_ids:
            try:  # int() itself decides ("--5", "²" pass an isdigit() test and then fail int())
                ids = [int(x) for x in s.split(",")]
            except ValueError:
                _usage_error(f"--prompt-token-ids: expected comma-separated ints with no empty items, got {s!r}")
            out.append({"prompt_token_ids": ids})
        return out
    return args.prompt or ["The capital of France is"]


def describe_setup(model: str, llm: Any) -> str:
    """Three lines: the model (folder, architecture), the draft setup (k, DSA index sharing, draft
    sampling mode, vocab-parallel local argmax) and the KV cache dtype (``--kv-cache-dtype``;
    ``auto`` = the model dtype)."""
    mcfg, spec = llm.model_config, llm.speculative_config
    lines = [f"model              {model} ({mcfg.architecture})"]
    if spec is None:
        lines.append("speculative        off (k = 0)")
    else:
        has_indexer = bool(getattr(mcfg.arch, "index_topk", None))
        share = ("index sharing " + ("on" if spec.index_share_for_mtp_iteration else "off")) if has_indexer \
            else "no DSA indexer"
        k = (f"k = 0..{spec.num_speculative_tokens} adaptive ({'deferred' if spec.defers_mtp_kv else 'eager'} MTP KV "
             "at k = 0)" if spec.adaptive else f"k = {spec.num_speculative_tokens}")
        argmax = "on" if spec.use_local_argmax_reduction else "off"  # -k turns it on, the JSON form does not
        lines.append(f"speculative        mtp, {k}, {share}, draft sampling {spec.draft_sampling}, "
                     f"local argmax {argmax}")
    lines.append(f"KV cache dtype     {llm.engine_config.cache_config.cache_dtype}")
    return "\n".join(lines)


def format_metrics(m: Dict[str, Any], adaptive: bool = False) -> str:
    """A compact multi-line summary of :meth:`LLM.get_metrics` (``adaptive``: the engine chooses k
    per step, so the steps per proposed k are shown even where every step proposed the full k)."""
    def f(x: Any, spec: str = ".3f") -> str:
        return "-" if x is None else format(x, spec)

    lines = [f"output tokens      {m['num_output_tokens']}  ({f(m['output_tokens_per_s'], '.1f')} tok/s over "
             f"{m['num_steps']} steps)",
             f"TTFT mean / p99    {f(m['ttft_s']['mean'])} / {f(m['ttft_s']['p99'])} s",
             f"ITL  mean / p99    {f(m['itl_s']['mean'])} / {f(m['itl_s']['p99'])} s"]
    if "num_drafts" in m:
        lines += [f"acceptance length  {f(m['acceptance_length'], '.3f')}  (rate {f(m['acceptance_rate'], '.3f')}, "
                  f"{m['num_accepted_tokens']}/{m['num_draft_tokens']} draft tokens)",
                  f"accepted per pos   {m['num_accepted_tokens_per_pos']}",
                  f"accepted lengths   {m['accepted_length_histogram']}  (histogram over 0..k)"]
        hist = m.get("num_speculative_tokens_histogram") or []
        if adaptive or any(hist[:-1]):  # adaptive speculation length (or some step proposed fewer than k)
            lines.append(f"steps proposing k  {hist}  (k = 0..{len(hist) - 1}); deferred MTP entries written later: "
                         f"{m.get('num_mtp_catch_up_tokens', 0)}")
    comm = m.get("comm_bytes_per_step") or {}
    lines.append("bytes/step (rank0) " + (", ".join(f"{op} {n:,.0f}" for op, n in sorted(comm.items())) or "0"))
    lines.append(f"eager fall-backs   {m['num_eager_fallbacks']}   preemptions {m['num_preemptions']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from mtpspec import LLM, SamplingParams

    from mtpspec.engine.arg_utils import EngineArgs, model_path_problem
    model = args.model or demo_model_path()
    why = model_path_problem(model, explicit=bool(args.model))
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    prompts = _prompts(args)
    if not prompts:
        print(f"error: no prompts: {args.prompt_file!r} has no non-empty line", file=sys.stderr)
        return 2
    try:
        engine_args = EngineArgs.from_cli_args(args)
        engine_args.model = model
        stop = args.stop if args.stop is not None else (["Question:"] if args.gsm8k_question else None)
        given = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k),
                                   ("max_tokens", args.max_tokens)) if v is not None}
        fixed = dict(seed=args.sampling_seed, stop=stop)
        SamplingParams(**{**CLI_SAMPLING_DEFAULTS, **given, **fixed})  # bad flags fail before the model loads
        llm = LLM(**engine_args.llm_kwargs())
    except (ValueError, TypeError, FileNotFoundError) as exc:  # FileNotFoundError: e.g. no weights
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        # flags given > the model's generation_config.json > this command's defaults
        params = SamplingParams(**{**CLI_SAMPLING_DEFAULTS, **llm.default_sampling_fields, **given, **fixed})
        outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 4)
        metrics = llm.get_metrics()
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        llm.shutdown()
    from mtpspec.distributed.launcher import torchrun_follower
    if torchrun_follower():  # under torchrun rank 0 prints (every rank printed, the others zero metrics)
        return 0
    if args.json:
        import json
        print(json.dumps({"outputs": [{"prompt": o.prompt, "prompt_token_ids": o.prompt_token_ids,
                                       "text": o.outputs[0].text, "token_ids": o.outputs[0].token_ids,
                                       "finish_reason": o.outputs[0].finish_reason} for o in outs],
                          "metrics": metrics}, default=str))
        return 0
    for i, o in enumerate(outs):
        c = o.outputs[0]
        head = o.prompt if o.prompt is not None else str(o.prompt_token_ids)
        print(f"--- [{i}] {head!r}")
        print(c.text if c.text else c.token_ids)
        print(f"    ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
        if args.gsm8k_question:
            ref = _gsm8k_examples(args)[i]["answer"].rsplit("####", 1)[-1].strip()
            print(f"    reference answer: {ref}")
    print("--- metrics")
    print(describe_setup(model, llm))
    print(format_metrics(metrics, adaptive=llm.llm_engine.spec_policy is not None))
    return 0

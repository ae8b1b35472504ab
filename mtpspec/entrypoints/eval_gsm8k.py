"""`mtpspec eval gsm8k`: GSM8K accuracy (5-shot, greedy) per engine arm, and whether the arms agree.

Prompts are lm-evaluation-harness's ``gsm8k`` format (:mod:`mtpspec.data.gsm8k`) built from
``--data`` (default: ``$MTPSPEC_GSM8K_DIR``, else the GSM8K copy bundled with the package):
``--num-fewshot`` solved examples from the train split, joined by a blank line, then
``"Question: ...\\nAnswer:"``. The shots are the first ``--num-fewshot`` rows of the train split
for every question (lm-eval draws them at random per question with a fixed seed; fixed shots
keep the prompts identical across arms and runs). Generation is greedy, stops at
``"Question:"``, ``"</s>"`` or ``"<|im_end|>"``, at most ``--max-tokens`` tokens (lm-eval's
default 256). Scores: strict-match and flexible-extract with standard errors, exactly as
lm-eval computes them (:mod:`mtpspec.entrypoints.eval_gsm8k_score`).

Sources of completions:

* ``--base-url URL`` (or several ``--base-url NAME=URL``): running `mtpspec serve` servers, one
  arm each; acceptance figures come from their ``/metrics``;
* ``--model PATH`` (default: the bundled demo model): offline ``LLM.generate``, once per arm of
  ``--arms`` (``baseline``: no fusion, no local argmax; ``fusion``; ``both``), or once with the
  engine flags given when ``--arms`` is not set.

With two or more arms it reports, per pair, how many questions got token-for-token identical
greedy completions (lossless speculative decoding and exact kernels should give all of them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mtpspec.entrypoints.bench_serve import api_key_headers
from mtpspec.entrypoints.eval_gsm8k_score import STOP_SEQUENCES, score_completions

#: ``--num-fewshot``'s default: lm-eval's 5-shot gsm8k (also the prompt self-distillation copies).
DEFAULT_NUM_FEWSHOT = 5
ARM_FLAGS = {"baseline": (False, False), "fusion": (True, False), "both": (True, True)}  # (fusion, local argmax)
#: A request the server refuses because its queue is full (503 ``server_overloaded``: ``--max-queue-len``) is retried, with
#: backoff from 50 ms doubling to 2 s, for up to this many seconds before the evaluation fails.
OVERLOAD_RETRY_S = 300.0


def build_prompts(test_rows: Sequence[Dict[str, str]], train_rows: Sequence[Dict[str, str]],
                  num_fewshot: int) -> List[str]:
    """One prompt per test row with the first ``num_fewshot`` train rows as shots.

    Raises:
        ValueError: fewer train rows than shots.
    """
    from mtpspec.data.gsm8k import fewshot_prompt
    if num_fewshot < 0:
        raise ValueError(f"--num-fewshot must be >= 0, got {num_fewshot}")
    if len(train_rows) < num_fewshot:
        raise ValueError(f"need {num_fewshot} train rows for the shots, have {len(train_rows)}")
    shots = list(train_rows[:num_fewshot])
    return [fewshot_prompt(shots, r["question"]) for r in test_rows]


# ---------------------------------------------------------------------------- sources
def _queue_full(r: Any) -> bool:
    """Whether response ``r`` is the server's 503 for a full queue (``server_overloaded``), which is
    worth retrying; any other 503 (the engine died: ``server_error``) is not."""
    if r.status_code != 503:
        return False
    try:
        return r.json()["error"]["type"] == "server_overloaded"
    except (ValueError, KeyError, TypeError):
        return False


def generate_http(base_url: str, prompts: Sequence[str], max_tokens: int, concurrency: int,
                  progress: bool = True, desc: str = "gsm8k") -> Dict[str, Any]:
    """Greedy completions from a running server: ``{"texts", "token_ids", "spec", "seconds"}``.
    A 503 (queue full) is retried for up to :data:`OVERLOAD_RETRY_S` seconds.

    Raises:
        RuntimeError: a request failed (the message has the server's error).
    """
    import httpx

    from mtpspec.entrypoints.bench_serve import NEUTRAL_SAMPLING, ServerInfo, scrape, server_root, spec_figures
    base_url = server_root(base_url)
    with httpx.Client(headers=api_key_headers(), timeout=600) as c:
        info = ServerInfo(base_url, c)
        before = scrape(base_url, c)

    async def go() -> List[Dict[str, Any]]:
        sem = asyncio.Semaphore(concurrency)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(prompts), desc=desc, unit="q", dynamic_ncols=True, file=sys.stderr)
        async with httpx.AsyncClient(headers=api_key_headers(), timeout=httpx.Timeout(3600.0)) as client:
            async def one(p: str) -> Dict[str, Any]:
                async with sem:
                    delay, deadline = 0.05, time.monotonic() + OVERLOAD_RETRY_S
                    while True:
                        r = await client.post(base_url + "/v1/completions", json={
                            "model": info.model, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0,
                            "stop": STOP_SEQUENCES, "return_token_ids": True, **NEUTRAL_SAMPLING})
                        if not _queue_full(r) or time.monotonic() + delay > deadline:
                            break
                        await asyncio.sleep(delay)  # back off and retry
                        delay = min(2 * delay, 2.0)
                if bar is not None:
                    bar.update(1)
                if r.status_code != 200:
                    raise RuntimeError(f"{base_url}: HTTP {r.status_code}: {r.text[:300]}")
                return r.json()["choices"][0]
            try:
                return list(await asyncio.gather(*(one(p) for p in prompts)))
            finally:
                if bar is not None:
                    bar.close()

    t0 = time.perf_counter()
    choices = asyncio.run(go())
    seconds = time.perf_counter() - t0
    with httpx.Client(headers=api_key_headers(), timeout=600) as c:
        after = scrape(base_url, c)
    k = int(info.info.get("num_speculative_tokens") or 0)
    spec = spec_figures(before, after, k)
    return {"texts": [ch["text"] for ch in choices], "token_ids": [ch["token_ids"] for ch in choices],
            "seconds": seconds, "acceptance_length": spec["acceptance_length"],
            "acceptance_rate_per_pos": spec["acceptance_rate_per_pos"], "server": info.info}


def generate_offline(llm_kwargs: Dict[str, Any], prompts: Sequence[str], max_tokens: int,
                     progress: bool = True) -> Dict[str, Any]:
    """Greedy completions with ``LLM(**llm_kwargs).generate`` (the engine is shut down after)."""
    from mtpspec import LLM, SamplingParams
    llm = LLM(**llm_kwargs)
    try:
        t0 = time.perf_counter()
        outs = llm.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=STOP_SEQUENCES),
                            use_tqdm=progress)
        seconds = time.perf_counter() - t0
        m = llm.get_metrics()
    finally:
        llm.shutdown()
        del llm
        _release_device_memory()  # the next arm sizes its KV cache from the free memory
    return {"texts": [o.outputs[0].text for o in outs], "token_ids": [o.outputs[0].token_ids for o in outs],
            "seconds": seconds, "acceptance_length": m.get("acceptance_length"),
            # per position: accepted / verifications that had a draft there (all of them at a fixed k)
            "acceptance_rate_per_pos": [a / n if n else None for a, n in zip(m.get("num_accepted_tokens_per_pos", []),
                                                                              m.get("num_draft_tokens_per_pos", []))],
            "server": None}


def _release_device_memory() -> None:
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- comparison
def compare_arms(token_ids: Dict[str, Sequence[Sequence[int]]]) -> Dict[str, Dict[str, Any]]:
    """Per pair of arms: identical completions and the first differing questions.

    Returns:
        ``{"B vs A": {"identical", "total", "first_differences": [{"question", "token"}]}}``
        (``token``: index of the first differing token).
    """
    names = list(token_ids)
    out = {}
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            a, b = token_ids[names[i]], token_ids[names[j]]
            diffs = []
            for q, (x, y) in enumerate(zip(a, b)):
                if list(x) != list(y):
                    t = next((n for n, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                    diffs.append({"question": q, "token": t})
            out[f"{names[j]} vs {names[i]}"] = {"identical": len(a) - len(diffs), "total": len(a),
                                                "first_differences": diffs[:10]}
    return out


def format_report(res: Dict[str, Any]) -> str:
    c = res["config"]
    shots = f"{c['num_fewshot']}-shot from {c['train']}" if c["num_fewshot"] else "0-shot"
    lines = [f"GSM8K: {c['data']} ({res['n']} question{'' if res['n'] == 1 else 's'}), {shots}, greedy, "
             f"max_tokens {c['max_tokens']}",
             f"{'arm':<12} {'strict-match':>18} {'flexible-extract':>18} {'acc. length':>12} {'seconds':>9}"]
    for arm, r in res["arms"].items():
        s, f = r["scores"]["strict-match"], r["scores"]["flexible-extract"]
        pm = lambda d: f"{d['accuracy']:.4f} ± {d['stderr']:.4f}" if d["stderr"] is not None else f"{d['accuracy']:.4f}"  # noqa: E731
        acc = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.3f}"
        lines.append(f"{arm:<12} {pm(s):>18} {pm(f):>18} {acc:>12} {r['seconds']:>9.1f}")
    if res["comparison"]:
        lines.append("greedy completions token-for-token identical:")
        for pair, cmp in res["comparison"].items():
            extra = ""
            if cmp["first_differences"]:
                extra = "; first differences: " + ", ".join(f"q{d['question']} at token {d['token']}"
                                                             for d in cmp["first_differences"][:5])
            lines.append(f"  {pair}: {cmp['identical']}/{cmp['total']} "
                         f"({100.0 * cmp['identical'] / max(cmp['total'], 1):.1f}%){extra}")
    return "\n".join(lines)


def evaluate(sources: Dict[str, Any], data: str, train: str, num_fewshot: int = DEFAULT_NUM_FEWSHOT, limit: Optional[int] = None,
             max_tokens: int = 256, concurrency: int = 32, progress: bool = True) -> Dict[str, Any]:
    """Run every arm and score it.

    Args:
        sources: arm -> base URL (str) or ``LLM`` keyword arguments (dict), in report order.
        data, train: GSM8K JSONL files (test questions; shots).
        num_fewshot, limit (first ``limit`` questions), max_tokens, concurrency (HTTP).

    Raises:
        ValueError / FileNotFoundError: bad files or settings; RuntimeError: a request failed.
    """
    from mtpspec.data.gsm8k import check_example, load_gsm8k
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        # a semaphore of 0 would send nothing and wait forever
        raise ValueError(f"--max-concurrency must be an int >= 1, got {concurrency!r}")
    rows = load_gsm8k(data)
    if limit is not None:
        if limit < 1:
            raise ValueError(f"--limit must be >= 1, got {limit}")
        rows = rows[:limit]
    for i, r in enumerate(rows):  # scoring reads each gold number (a new-user pass: a row without one scored 0)
        try:
            check_example(r["question"], r["answer"])
        except ValueError as exc:
            raise ValueError(f"{data}: question {i + 1}'s {exc}") from None
    # no shots: the train file is not read (it need not exist)
    prompts = build_prompts(rows, load_gsm8k(train) if num_fewshot else [], num_fewshot)
    answers = [r["answer"] for r in rows]
    arms: Dict[str, Any] = {}
    for name, src in sources.items():
        if isinstance(src, str):
            gen = generate_http(src, prompts, max_tokens, concurrency, progress, desc=f"gsm8k {name}")
        else:
            gen = generate_offline(src, prompts, max_tokens, progress)
        scores = score_completions(gen["texts"], answers)
        arms[name] = {**gen, "scores": scores, "source": src if isinstance(src, str) else "offline"}
    comparison = compare_arms({a: r["token_ids"] for a, r in arms.items()}) if len(arms) > 1 else {}
    return {"config": {"data": data, "train": train, "num_fewshot": num_fewshot, "limit": limit,
                       "max_tokens": max_tokens}, "n": len(rows), "arms": arms, "comparison": comparison}


def add_parser(sub: Any) -> None:
    from mtpspec.entrypoints.serve import add_engine_args
    p = sub.add_parser("eval", help="accuracy evaluations: eval gsm8k")
    inner = p.add_subparsers(dest="eval_command", required=True)
    g = inner.add_parser("gsm8k", help="GSM8K 5-shot accuracy per arm", description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("--base-url", action="append", default=[], metavar="[NAME=]URL",
                   help="a running mtpspec serve (repeat with NAME=URL for several arms)")
    add_engine_args(g)
    g.add_argument("--arms", default=None, help="with --model: comma-separated arms among baseline,fusion,both")
    g.add_argument("--data", default=None,
                   help="GSM8K test JSONL, or a folder with test.jsonl and train.jsonl (default: $MTPSPEC_GSM8K_DIR, "
                        "else the copy bundled in mtpspec/data/gsm8k)")
    g.add_argument("--train", default=None,
                   help="JSONL of the shots, or a folder with train.jsonl (default: train.jsonl beside the test file)")
    g.add_argument("--num-fewshot", type=int, default=DEFAULT_NUM_FEWSHOT,
                   help=f"solved train examples before each question (default {DEFAULT_NUM_FEWSHOT})")
    g.add_argument("--limit", type=int, default=None, help="first N questions only (default: all)")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens per completion (default 256, lm-eval's)")
    g.add_argument("--max-concurrency", type=int, default=32, help="requests in flight per server (default 32)")
    g.add_argument("--json", default=None, help="write every completion and score to this file")
    g.add_argument("--no-progress", action="store_true")


def _sources(args: argparse.Namespace) -> Dict[str, Any]:
    """Arm name -> base URL (``--base-url``) or ``LLM`` keyword arguments (``--model`` / ``--arms``).

    Raises:
        ValueError: ``--base-url`` with ``--model`` / ``--arms``, an arm named twice (by ``--base-url
            NAME=URL`` or ``--arms``), an unknown or no arm, a flag an arm would override, a bad model path.
    """
    from mtpspec.entrypoints.serve import default_model_path, llm_kwargs
    if args.base_url:
        if args.arms or args.model:
            raise ValueError("give either --base-url or --model/--arms, not both")
        out = {}
        for i, spec in enumerate(args.base_url):
            name, sep, url = spec.partition("=")
            if not (sep and not name.startswith("http")):
                name, url = (f"server{i}" if len(args.base_url) > 1 else "server"), spec
            if name in out:  # (the later one replaced the earlier, silently: one arm evaluated)
                raise ValueError(f"--base-url names the arm {name!r} twice ({out[name]} and {url}); give each "
                                 "server its own NAME=URL")
            out[name] = url
        return out
    base = llm_kwargs(args)
    from mtpspec.engine.arg_utils import model_path_problem
    why = model_path_problem(base["model"] or default_model_path(), explicit=bool(base["model"]))
    if why is not None:
        raise ValueError(why + " (or --base-url URL)")
    if args.arms is None:
        return {"model": base}
    if not [a for a in args.arms.split(",") if a.strip()]:
        raise ValueError(f"--arms {args.arms!r} names no arm; expected some of {list(ARM_FLAGS)}, comma-separated")
    # each arm sets the fused tail and the local argmax itself: a flag that sets either would be overridden
    from mtpspec.engine.arg_utils import parse_speculative_config  # (llm_kwargs checked the JSON already)
    spec_keys = parse_speculative_config(getattr(args, "speculative_config", None)) or {}
    set_by_flags = [f for f, on in (("--no-fusion", getattr(args, "no_fusion", False)),
                                    ("--no-local-argmax", getattr(args, "no_local_argmax", False)),
                                    ("--speculative-config's use_local_argmax_reduction",
                                     "use_local_argmax_reduction" in spec_keys)) if on]
    if set_by_flags:
        per_arm = "; ".join(f"{n}: fusion {f}, local argmax {la}" for n, (f, la) in ARM_FLAGS.items())
        raise ValueError(f"--arms sets the fused tail and the local argmax per arm ({per_arm}); drop "
                         f"{' and '.join(set_by_flags)}, or drop --arms for one run with them")
    out = {}
    for name in [a.strip() for a in args.arms.split(",") if a.strip()]:
        if name not in ARM_FLAGS:
            raise ValueError(f"unknown arm {name!r}; expected some of {list(ARM_FLAGS)}")
        if name in out:
            raise ValueError(f"--arms names {name!r} twice ({args.arms!r}); name each arm once")
        if base["speculative_config"] is None:
            raise ValueError("--arms compare draft-path variants; they need -k >= 1")
        fusion, local = ARM_FLAGS[name]
        spec = dict(base["speculative_config"], use_local_argmax_reduction=local)
        out[name] = dict(base, fuse_allreduce_rmsnorm=fusion, speculative_config=spec)
    return out


def data_files(data: Optional[str] = None, train: Optional[str] = None, num_fewshot: int = 1) -> Tuple[str, str]:
    """The test and shots files: ``data`` (file or folder) else ``$MTPSPEC_GSM8K_DIR`` else the
    bundled test split (:func:`mtpspec.data.gsm8k.resolve_gsm8k`); ``train`` (file or folder) else
    ``train.jsonl`` beside the test file. With ``num_fewshot`` 0 no shots file is needed: ``train`` is
    returned as given (``""`` when not), unchecked.

    Raises:
        mtpspec.data.gsm8k.GSM8KNotFoundError (a ``FileNotFoundError``): a file is missing; the
            message names the flag (``--data`` / ``--train``) and the path.
    """
    from mtpspec.data.gsm8k import resolve_gsm8k
    data = resolve_gsm8k("test", data, "--data")
    if num_fewshot == 0:
        return data, train or ""
    if not train:
        train, source = os.path.dirname(os.path.abspath(data)), "--train (default: beside the test file)"
    else:
        source = "--train"
    return data, resolve_gsm8k("train", train, source)


def fewer_shots(message: str, num_fewshot: int) -> int:
    """The few-shot count to suggest after ``message`` (the engine's or the server's "maximum
    context length is L tokens ... P input tokens / P in the messages") refused a ``num_fewshot``-shot
    prompt: with the prompt's tokens shared evenly by its shots and its question, the most shots
    whose prompt fits in ``L - 1`` tokens (at most ``num_fewshot - 1``, at least 0); without those
    figures in the message, ``num_fewshot - 1``."""
    limit = re.search(r"maximum context length is (\d+) tokens", message)
    used = re.search(r"has (\d+) input tokens|\((\d+) in the messages", message)
    if not (limit and used):
        return max(0, num_fewshot - 1)
    per_part = int(used.group(1) or used.group(2)) / (num_fewshot + 1)  # tokens a shot (or the question) takes
    return max(0, min(num_fewshot - 1, int((int(limit.group(1)) - 1) / per_part) - 1))


def run(args: argparse.Namespace) -> int:
    import httpx

    from mtpspec.entrypoints.bench_serve import output_path_problem
    why = output_path_problem(args.json)
    if why is not None:
        print(f"error: --json: {why}", file=sys.stderr)
        return 2
    try:
        data, train = data_files(args.data, args.train, args.num_fewshot)
        res = evaluate(_sources(args), data, train, args.num_fewshot, args.limit, args.max_tokens,
                       args.max_concurrency, progress=not args.no_progress)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as exc:
        hint = ""
        # the few-shot prompt outgrew the context (the engine's and the server's message: vLLM's wording)
        if "maximum context length" in str(exc) and args.num_fewshot > 0:
            shots = fewer_shots(str(exc), args.num_fewshot)  # (0 was "try --num-fewshot 0 or fewer")
            hint = (f" (the {args.num_fewshot}-shot prompts are too long for this model: try --num-fewshot "
                    f"{shots}{' or fewer' if shots else ''})")
        print(f"error: {exc}{hint}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:  # server unreachable, timed out, bad URL
        print(f"error: talking to {', '.join(args.base_url)}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    from mtpspec.distributed.launcher import torchrun_follower
    if torchrun_follower():  # under torchrun rank 0 reports and writes --json (the others had no acceptance figures)
        return 0
    print(format_report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0

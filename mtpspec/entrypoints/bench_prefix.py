"""`mtpspec bench serve --shared-prefix`: time to first token of prefix-cache hits against misses.

Workload: GSM8K few-shot prompts in lm-eval's format (``--num-shots``, default 5) that share one
few-shot prefix (the same solved examples) and differ in the question. Requests go one at a
time (TTFT without queueing), in pairs: the server's prefix cache is emptied (``POST
/reset_prefix_cache``), then a *miss* (a prompt computed whole; it writes the shared prefix into
the cache) and a *hit* (the next question, which finds the prefix cached). ``warmup`` unmeasured
requests go first. Misses and hits come from the same prompt distribution, so their TTFTs
differ by the cache alone. Every request is also measured on the server: the tokens the prefix
cache served it are the ``mtpspec:prefix_cache_hits_total`` delta around it (``/metrics``).
Other clients of the server would disturb both.

Reported: TTFT median / mean / p99 of hits and of misses (client side, and the server's own
TTFT, queue and prefill times from its ``/metrics`` sums around each request, so a gap between
the two shows time spent outside the engine), their ratio (hit median / miss
median; issue 17's goal is <= 0.3 on a GPU), prompt tokens and tokens served from the cache per
request of each kind.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Sequence, Tuple

import httpx

from mtpspec.data.gsm8k import fewshot_prompt
from mtpspec.entrypoints.bench_serve import api_key_headers

HITS_METRIC = "mtpspec:prefix_cache_hits_total"
# Server-side per-request figures, as deltas of these sums around each request (seconds / steps).
SERVER_SUMS = {"server_ttft": "mtpspec:time_to_first_token_seconds_sum",
               "server_queue": "mtpspec:request_queue_time_seconds_sum",
               "server_prefill": "mtpspec:request_prefill_time_seconds_sum",
               "engine_steps": "mtpspec:engine_steps_total"}


def prefix_prompts(rows: Sequence[Dict[str, str]], num_prompts: int, num_shots: int = 5,
                   seed: int = 0) -> Tuple[List[str], str]:
    """``(prompts, the shared prefix)``: ``num_prompts`` questions, each after the same
    ``num_shots`` solved examples (rows from an offset set by ``seed``, the questions the rows
    after them).

    Raises:
        ValueError: ``num_shots < 1`` or fewer than ``num_shots + num_prompts`` rows.
    """
    n = len(rows)
    if num_shots < 1 or n < num_shots + num_prompts:
        raise ValueError(f"need num_shots >= 1 and at least {num_shots + num_prompts} GSM8K rows, got "
                         f"num_shots={num_shots} and {n} rows")
    at = lambda i: rows[(seed * 7919 + i) % n]  # noqa: E731
    shots = [at(j) for j in range(num_shots)]
    prompts = [fewshot_prompt(shots, at(num_shots + i)["question"]) for i in range(num_prompts)]
    prefix = fewshot_prompt(shots, "x")[:-len("Question: x\nAnswer:")]
    return prompts, prefix


def _ttft(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int, seed: int) -> Dict[str, Any]:
    """One streaming completion: TTFT (s, ``None`` without tokens), prompt tokens, or an error."""
    from mtpspec.entrypoints.bench_serve import NEUTRAL_SAMPLING
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "seed": seed, "return_token_ids": True, **NEUTRAL_SAMPLING}
    rec: Dict[str, Any] = {"ttft": None, "prompt_tokens": 0, "error": ""}
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            rec["error"] = f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')[:300]}"
            return rec
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                rec["error"] = chunk["error"].get("message", "error")
                return rec
            if chunk.get("usage"):
                rec["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
            if rec["ttft"] is None and any(ch.get("token_ids") for ch in chunk.get("choices", [])):
                rec["ttft"] = time.perf_counter() - t0
    return rec


def run_prefix_benchmark(base_url: str, cfg: Any, num_shots: int = 5) -> Dict[str, Any]:
    """Run the workload (module docstring) against ``base_url``; ``cfg`` is a
    :class:`~mtpspec.entrypoints.bench_serve.BenchConfig` (``num_prompts``, ``output_len``,
    ``dataset``, ``seed``, ``warmup`` are used). Returns every figure.

    Raises:
        ValueError: a request failed (the first error is named, with a hint when prompts are
            longer than the context), or too few dataset rows.
        httpx.HTTPError: the server cannot be reached.
    """
    from mtpspec.entrypoints.bench_dataset import load_dataset
    from mtpspec.entrypoints.bench_serve import ServerInfo, _ms, scrape, server_root
    base_url = server_root(base_url)
    prompts, prefix = prefix_prompts(load_dataset(cfg.dataset), cfg.warmup + 2 * cfg.num_prompts, num_shots, cfg.seed)
    recs: Dict[str, List[Dict[str, Any]]] = {"hit": [], "miss": []}
    with httpx.Client(headers=api_key_headers(), timeout=httpx.Timeout(3600.0)) as client:
        info = ServerInfo(base_url, client)

        def reset() -> None:
            r = client.post(base_url + "/reset_prefix_cache")
            if r.status_code != 200:
                raise ValueError(f"POST /reset_prefix_cache answered HTTP {r.status_code}: {r.text[:200]}")

        def send(kind: str, i: int) -> None:
            before = scrape(base_url, client)
            if HITS_METRIC not in before:
                raise ValueError(f"the server exposes no {HITS_METRIC} (not an mtpspec serve with prefix caching?)")
            rec = _ttft(client, base_url, info.model, prompts[i], cfg.output_len, cfg.seed + i)
            if rec["error"] or rec["ttft"] is None:
                hint = ""
                if "maximum context length" in rec["error"] or "max_model_len" in rec["error"]:
                    hint = " (the few-shot prompts are longer than the server's context: lower --num-shots)"
                raise ValueError(f"{kind} request {i} failed: {rec['error'] or 'no tokens streamed'}{hint}")
            after = scrape(base_url, client)
            rec["cached_tokens"] = int(after[HITS_METRIC] - before[HITS_METRIC])
            for name, key in SERVER_SUMS.items():
                rec[name] = after[key] - before[key] if key in after and key in before else None
            if kind in recs:
                recs[kind].append(rec)

        for i in range(cfg.warmup):
            reset()
            send("warmup", i)
        for j in range(cfg.num_prompts):
            reset()
            send("miss", cfg.warmup + 2 * j)
            send("hit", cfg.warmup + 2 * j + 1)
        prefix_tokens = len(client.post(base_url + "/tokenize", json={"prompt": prefix}).json()["tokens"])

    def summary(kind: str) -> Dict[str, Any]:
        rs = recs[kind]
        server = {name: _ms([r[name] for r in rs]) for name in ("server_ttft", "server_queue", "server_prefill")
                  if all(r[name] is not None for r in rs)}
        return {"ttft_ms": _ms([r["ttft"] for r in rs]), **{f"{k}_ms": v for k, v in server.items()},
                "mean_prompt_tokens": sum(r["prompt_tokens"] for r in rs) / len(rs),
                "mean_cached_tokens": sum(r["cached_tokens"] for r in rs) / len(rs),
                "requests_served_from_cache": sum(1 for r in rs if r["cached_tokens"] > 0)}

    hit, miss = summary("hit"), summary("miss")
    ratio = None
    if hit["ttft_ms"]["median"] and miss["ttft_ms"]["median"]:
        ratio = hit["ttft_ms"]["median"] / miss["ttft_ms"]["median"]
    return {"server": {"base_url": base_url, "model": info.model, "max_model_len": info.max_model_len, **info.info},
            "config": {**cfg.as_json(), "num_shots": num_shots}, "shared_prefix_tokens": prefix_tokens,
            "hit": hit, "miss": miss, "ttft_hit_over_miss": ratio,
            "requests": {k: [{"ttft_s": r["ttft"], "prompt_tokens": r["prompt_tokens"],
                              "cached_tokens": r["cached_tokens"],
                              **{name: r[name] for name in SERVER_SUMS}} for r in v] for k, v in recs.items()}}


def format_prefix_result(res: Dict[str, Any]) -> str:
    """A compact table of one run."""
    f = lambda x, spec=".2f": "-" if x is None else format(x, spec)  # noqa: E731
    s, c = res["server"], res["config"]
    lines = ["=" * 72, "mtpspec bench serve --shared-prefix (prefix-cache TTFT)", "=" * 72,
             f"server                      {s.get('model')}  (k={s.get('num_speculative_tokens')} tp={s.get('tp')} "
             f"prefix caching={s.get('enable_prefix_caching')})",
             f"workload                    {c['num_prompts']} (miss, hit) pairs, one request at a time, "
             f"{c['num_shots']}-shot GSM8K, out {c['output_len']}",
             f"shared prefix               {res['shared_prefix_tokens']} tokens"]
    for kind in ("hit", "miss"):
        r = res[kind]
        t = r["ttft_ms"]
        lines.append(f"TTFT {kind:<4} median / mean / p99  {f(t['median'])} / {f(t['mean'])} / {f(t['p99'])} ms   "
                     f"(prompt {r['mean_prompt_tokens']:.0f} tok, from cache {r['mean_cached_tokens']:.0f} tok)")
        if "server_ttft_ms" in r:
            lines.append(f"  server side medians        TTFT {f(r['server_ttft_ms']['median'])}, queue "
                         f"{f(r['server_queue_ms']['median'])}, prefill {f(r['server_prefill_ms']['median'])} ms")
    lines.append(f"TTFT hit / miss (medians)   {f(res['ttft_hit_over_miss'], '.3f')}")
    if res["miss"]["requests_served_from_cache"] or res["hit"]["requests_served_from_cache"] < c["num_prompts"]:
        lines.append(f"WARNING: {res['miss']['requests_served_from_cache']} misses were served from the cache and "
                     f"{c['num_prompts'] - res['hit']['requests_served_from_cache']} hits were not "
                     "(other clients? prefix caching off?)")
    lines.append("=" * 72)
    return "\n".join(lines)

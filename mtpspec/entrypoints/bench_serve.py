"""`mtpspec bench serve`: a load generator for a running `mtpspec serve` (like vLLM's ``bench serve``).

Sends ``num_prompts`` streaming ``/v1/completions`` requests, at most ``max_concurrency`` at a
time, and measures on the client:

* output tokens/s: output tokens (from each request's ``usage``) over the run's wall time; requests/s:
  completed requests over it;
* TTFT: request sent -> first streamed chunk with tokens; ITL: gap between a request's
  consecutive chunks (one chunk per engine step, which may carry several tokens under
  speculation); TPOT: per request ``(latency - TTFT) / (output tokens - 1)``; median and p99.

and from the server's ``/metrics`` before and after the run (deltas):

* acceptance length ``1 + accepted / drafts`` and the per-position acceptance rates
  ``accepted_at_position_j / drafts``;
* steps/s ``= output tokens/s / acceptance length`` (throughput normalised by acceptance, so
  that speculation luck cannot pass for speed); also the engine's own steps/s;
* collective bytes per engine step (rank 0, by op);
* the prefix cache's hit rate (prompt tokens served from it / looked up).

Arrivals (vLLM's ``--request-rate`` / ``--burstiness``): by default every request is sent at once and
only ``--max-concurrency`` limits them (a closed loop). With ``--request-rate R`` request ``i`` is sent
at its arrival time (:func:`arrival_times`: gaps drawn from a gamma distribution of shape
``--burstiness`` and mean ``1 / R``, seeded by ``--seed``, scaled so that the last goes at
``num_prompts / R``, as vLLM does); an arrival finding ``--max-concurrency`` requests in flight waits
for one to end (both limits apply, as in vLLM; without ``--max-concurrency`` a rate has no
concurrency limit). TTFT counts from the send, not the arrival. The warm-up is never paced.

vLLM's flag spellings are accepted too: ``--dataset-name {gsm8k,random}`` (random: ``--random-prompts``),
``--dataset-path`` (``--dataset``), ``--random-input-len`` (``--input-len``), ``--random-output-len``
(``--output-len``); both spellings of one option with different values are an error.

Each run starts with an empty prefix cache (``POST /reset_prefix_cache`` before its warm-up), so
repeated runs of the same prompts (``bench arms --repeats``) do the same prefill work.

Runs with random-token prompts, ``ignore_eos`` or a server with forced acceptance are marked
SYNTHETIC in every table and in the JSON (``"synthetic": true`` with the reasons).

``--shared-prefix`` runs another workload instead: TTFT of prefix-cache hits against misses on
GSM8K few-shot prompts (:mod:`mtpspec.entrypoints.bench_prefix`). ``--prefill-interference``
another: ITL of running decodes while clients send long prompts, before and during, and issue
17's verdict (:mod:`mtpspec.entrypoints.bench_interference`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence

import httpx


@dataclass
class BenchConfig:
    """One run's workload.

    Attributes:
        num_prompts, max_concurrency, input_len (``None``: natural GSM8K 5-shot prompts),
        output_len (``max_tokens``), prompts (``"gsm8k"`` or ``"random"``), dataset (GSM8K JSONL
        file or folder, or ``None``: ``$MTPSPEC_GSM8K_DIR``, else the bundled test split),
        ignore_eos, temperature, seed, warmup (requests sent first, at most ``max_concurrency`` at
        a time, and not measured), warmup_output_len (their ``max_tokens``; ``None``: output_len).
        request_seeds: request ``i`` carries ``seed + i`` as its own sampling seed (reproducible
            sampled runs); ``False``: no request seed (the server's engine seed draws them; under
            adaptive speculation a seeded request keeps argmax drafts, docs/serving.md).
        request_rate: arrivals per second (``inf``: all at once; :func:`arrival_times`), burstiness: the
            shape of their gaps' gamma distribution (1: Poisson arrivals).

    Raises:
        ValueError: a count or length below 1, a negative warm-up, an unknown ``prompts``, a
            temperature that is negative or not finite, a request rate not > 0 or a burstiness not
            finite and > 0.
    """

    num_prompts: int = 64
    max_concurrency: int = 8
    input_len: Optional[int] = None
    output_len: int = 256
    prompts: str = "gsm8k"
    dataset: Optional[str] = None
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    request_seeds: bool = True
    warmup: int = 1
    warmup_output_len: Optional[int] = None
    request_rate: float = math.inf
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_concurrency", "output_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.input_len is not None and (not isinstance(self.input_len, int) or self.input_len < 1):
            raise ValueError(f"input_len must be an int >= 1 or None, got {self.input_len!r}")
        if self.prompts not in ("gsm8k", "random"):
            raise ValueError(f"prompts must be 'gsm8k' or 'random', got {self.prompts!r}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not (math.isfinite(self.temperature) and self.temperature >= 0):
            # (SamplingParams' rule; bench arms checked it only once every arm was up)
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.warmup_output_len is not None and (not isinstance(self.warmup_output_len, int)
                                                   or self.warmup_output_len < 1):
            raise ValueError(f"warmup_output_len must be an int >= 1 or None, got {self.warmup_output_len!r}")
        _check_arrivals(self.request_rate, self.burstiness)

    def as_json(self) -> Dict[str, Any]:
        """The fields as a dict for JSON, an infinite ``request_rate`` written ``"inf"`` (as vLLM's results)."""
        return {**asdict(self), "request_rate": "inf" if self.request_rate == math.inf else self.request_rate}

    def request_seed(self, i: int) -> Optional[int]:
        """Request ``i``'s own sampling seed: ``seed + i``, or ``None`` without :attr:`request_seeds`."""
        return self.seed + i if self.request_seeds else None


@dataclass
class RequestRecord:
    """Client-side timings of one request (seconds, ``time.perf_counter``)."""

    ok: bool = False
    error: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    latency: float = 0.0
    ttft: Optional[float] = None
    chunk_gaps: List[float] = field(default_factory=list)


# ---------------------------------------------------------------------------- server access
def api_key_headers() -> Dict[str, str]:
    """The ``Authorization`` header mtpspec's own clients (``bench``, ``eval gsm8k --base-url``) send:
    ``Bearer $OPENAI_API_KEY`` when that variable is set (what vLLM's benchmark clients read), for a
    server started with ``--api-key``; else none."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def server_root(base_url: str) -> str:
    """The server's root URL: trailing slashes and a trailing ``/v1`` (the form an OpenAI client's
    ``base_url`` takes) removed; the benches add ``/v1/...`` themselves."""
    url = base_url.rstrip("/")
    return url[:-3].rstrip("/") if url.endswith("/v1") else url


def output_path_problem(path: Optional[str]) -> Optional[str]:
    """Why results cannot be written to ``path`` (``None``: they can, or no path), checked before a
    run so that a typo does not cost the run's results."""
    if not path:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path!r} is a folder; give a file name"
    if os.path.exists(path):  # an existing file (or /dev/stdout): its own permission counts
        return None if os.access(path, os.W_OK) else f"cannot write {path!r}"
    if not os.path.isdir(folder):
        return f"no folder {folder!r} for {path!r}"
    if not os.access(folder, os.W_OK):
        return f"cannot write in {folder!r}"
    return None


class ServerInfo:
    """What ``/v1/models`` says about the server.

    Raises:
        ValueError: ``/v1/models`` refused the API key (HTTP 401 / 403: ``$OPENAI_API_KEY`` missing or
            wrong) or did not answer with a model list (not a server root URL).
    """

    def __init__(self, base_url: str, client: httpx.Client):
        r = client.get(base_url + "/v1/models")
        if r.status_code in (401, 403):
            sent = "sent the key in $OPENAI_API_KEY" if os.environ.get("OPENAI_API_KEY") else "sent no key"
            raise ValueError(f"GET {base_url}/v1/models answered HTTP {r.status_code}: the server wants an API key "
                             f"(its --api-key) and this client {sent}; set OPENAI_API_KEY to the server's key")
        try:
            data = r.json()["data"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ValueError(f"GET {base_url}/v1/models answered HTTP {r.status_code} without a model list: give "
                             "the server's root URL (e.g. http://127.0.0.1:8000)") from None
        self.model: str = data["id"]
        self.max_model_len: int = int(data.get("max_model_len") or 0)
        self.vocab_size: int = int(data.get("vocab_size") or 0)
        self.info: Dict[str, Any] = data.get("mtpspec") or {}

    @property
    def forced_acceptance(self) -> Optional[str]:
        fa = self.info.get("forced_acceptance")
        return None if fa in (None, "off") else str(fa)


def scrape(base_url: str, client: httpx.Client) -> Dict[str, float]:
    """``/metrics`` as ``{"name{label=value,...}": value}`` (``_total`` names as exposed)."""
    return parse_metrics(client.get(base_url + "/metrics").text)


def parse_metrics(text: str) -> Dict[str, float]:
    """A Prometheus exposition as ``{"name{label=value,...}": value}``, without the ``model_name``
    label every sample carries (a bench talks to one served model)."""
    from prometheus_client.parser import text_string_to_metric_families
    out: Dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = sorted((k, v) for k, v in s.labels.items() if k != "model_name")
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in labels) + "}" if labels else "")
            out[key] = float(s.value)
    return out


def spec_figures(before: Dict[str, float], after: Dict[str, float], k: int) -> Dict[str, Any]:
    """Server-side deltas: drafts, acceptance length and per-position rates, steps, collective bytes."""
    d = lambda key: after.get(key, 0.0) - before.get(key, 0.0)  # noqa: E731
    drafts = d("mtpspec:spec_decode_num_drafts_total")
    accepted = d("mtpspec:spec_decode_num_accepted_tokens_total")
    steps = d("mtpspec:engine_steps_total")
    per_pos = [d(f"mtpspec:spec_decode_num_accepted_tokens_per_pos_total{{position={j}}}") for j in range(k)]
    # verifications that reached position j (all drafts at a fixed k; fewer when adaptive k proposed less)
    per_pos_drafts = [d(f"mtpspec:spec_decode_num_draft_tokens_per_pos_total{{position={j}}}") for j in range(k)]
    chosen = [d(f"mtpspec:spec_decode_num_speculative_tokens_total{{k={j}}}") for j in range(k + 1)] if k else []
    comm = {}
    for key in after:
        if key.startswith("mtpspec:collective_bytes_total{"):
            op = key[len("mtpspec:collective_bytes_total{op="):-1]
            comm[op] = d(key)
    return {
        "num_drafts": drafts, "num_draft_tokens": d("mtpspec:spec_decode_num_draft_tokens_total"),
        "num_accepted_tokens": accepted,
        "acceptance_length": (1.0 + accepted / drafts) if drafts > 0 else None,
        "acceptance_rate_per_pos": [(a / n) if n > 0 else None
                                    for a, n in zip(per_pos, per_pos_drafts if any(per_pos_drafts) else [drafts] * k)],
        "num_speculative_tokens_histogram": chosen,
        "engine_steps": steps, "server_generation_tokens": d("mtpspec:generation_tokens_total"),
        "collective_bytes_per_step": {op: (b / steps if steps else 0.0) for op, b in sorted(comm.items())},
        "collective_bytes_per_step_total": (sum(comm.values()) / steps) if steps else 0.0,
        "preemptions": d("mtpspec:num_preemptions_total"), "eager_fallbacks": d("mtpspec:eager_fallbacks_total"),
        "prefix_cache_hit_rate": (d("mtpspec:prefix_cache_hits_total") / d("mtpspec:prefix_cache_queries_total")
                                  if d("mtpspec:prefix_cache_queries_total") > 0 else None),
    }


# ---------------------------------------------------------------------------- load
#: Sent with every benchmark request: a served model's generation_config.json gives the defaults of
#: fields a request leaves unset (vLLM's rule), and a workload must not change with the checkpoint.
NEUTRAL_SAMPLING = {"top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}


def _check_arrivals(rate: Any, burstiness: Any) -> None:
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    if not (number(rate) and rate > 0):  # (nan fails it too)
        raise ValueError(f"request_rate must be a number > 0 in requests/s (inf: all at once), got {rate!r}")
    if not (number(burstiness) and 0 < burstiness < math.inf):
        raise ValueError(f"burstiness must be a finite number > 0 (1: Poisson arrivals), got {burstiness!r}")


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> List[float]:
    """When each of ``n`` requests is sent, in seconds from the run's start (vLLM's arrivals).

    The gaps are drawn from a gamma distribution of shape ``burstiness`` and mean ``1 / rate`` (variance
    ``1 / (burstiness * rate**2)``: 1 is a Poisson process, below 1 burstier, above 1 more regular) by a
    ``random.Random(seed)``, then all scaled by one factor so that the last request goes at exactly
    ``n / rate`` s (as vLLM does: the offered load is ``rate`` whatever the draws). ``rate`` inf: all at 0;
    all at 0 too where every gap underflowed to 0 (a burstiness of ~0.001 and a few requests; vLLM's rule).

    Raises:
        ValueError: ``rate`` not > 0 (in requests/s), or ``burstiness`` not finite and > 0.
    """
    _check_arrivals(rate, burstiness)
    if rate == math.inf:
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    if t == 0:  # every gap underflowed to 0 (a tiny burstiness): all at once, as vLLM (no scaling)
        return [0.0] * n
    # each its fraction of the last, times n / rate: a factor (n / rate) / t overflowed to inf where t was
    # subnormal (the run then slept forever on that arrival)
    return [x / t * (n / rate) for x in out]


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: Any, cfg: BenchConfig,
               seed: Optional[int]) -> RequestRecord:
    rec = RequestRecord()
    body = {"model": model, "prompt": prompt, "max_tokens": cfg.output_len, "temperature": cfg.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": cfg.ignore_eos,
            "seed": seed, "return_token_ids": True, **NEUTRAL_SAMPLING}
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.error = chunk["error"].get("message", "error")
                    return rec
                if chunk.get("usage"):
                    rec.input_tokens = chunk["usage"]["prompt_tokens"]
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                for ch in chunk.get("choices", []):
                    if ch.get("token_ids"):
                        now = time.perf_counter()
                        if rec.ttft is None:
                            rec.ttft = now - t0
                        else:
                            rec.chunk_gaps.append(now - last)
                        last = now
        rec.latency = time.perf_counter() - t0
        rec.ok = rec.ttft is not None
        if not rec.ok:
            rec.error = "no tokens streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


async def _run_load(url: str, model: str, prompts: Sequence[Any], cfg: BenchConfig, progress: bool,
                    desc: str) -> List[RequestRecord]:
    sem = asyncio.Semaphore(cfg.max_concurrency)
    limits = httpx.Limits(max_connections=cfg.max_concurrency + 4, max_keepalive_connections=cfg.max_concurrency + 4)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(prompts), desc=desc, unit="req", leave=False, dynamic_ncols=True, file=sys.stderr)
    send_at = arrival_times(len(prompts), cfg.request_rate, cfg.burstiness, cfg.seed)
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(headers=api_key_headers(), timeout=httpx.Timeout(3600.0), limits=limits) as client:
        start = loop.time()

        async def guarded(i: int, p: Any) -> RequestRecord:
            if send_at[i] > 0:  # its arrival; then, as in vLLM, a --max-concurrency slot
                await asyncio.sleep(start + send_at[i] - loop.time())
            async with sem:
                rec = await _one(client, url, model, p, cfg, cfg.request_seed(i))
            if bar is not None:
                bar.update(1)
            return rec
        try:
            return list(await asyncio.gather(*(guarded(i, p) for i, p in enumerate(prompts))))
        finally:
            if bar is not None:
                bar.close()


def _pct(xs: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile ``q`` in [0, 100] (numpy's default), ``None`` when empty."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _ms(xs: Sequence[float]) -> Dict[str, Optional[float]]:
    xs = [x * 1000.0 for x in xs]
    return {"median": _pct(xs, 50), "p99": _pct(xs, 99), "mean": statistics.fmean(xs) if xs else None}


def run_benchmark(base_url: str, cfg: BenchConfig, progress: bool = True, desc: str = "bench") -> Dict[str, Any]:
    """Run one workload against ``base_url``; returns every figure (see the module docstring).

    Raises:
        ValueError: the workload does not fit the server's context (``input_len + output_len >
            max_model_len``, or ``output_len >= max_model_len`` with natural prompts), or no request
            succeeded (natural prompts longer than the context: the message says to pass ``input_len``).
        httpx.HTTPError: the server cannot be reached.
    """
    base_url = server_root(base_url)
    with httpx.Client(headers=api_key_headers(), timeout=600.0) as client:
        info = ServerInfo(base_url, client)
        if cfg.input_len is not None and info.max_model_len and cfg.input_len + cfg.output_len > info.max_model_len:
            raise ValueError(f"input_len {cfg.input_len} + output_len {cfg.output_len} exceed the server's "
                             f"max_model_len {info.max_model_len}; lower them (or --scale for presets)")
        if cfg.input_len is None and info.max_model_len and cfg.output_len >= info.max_model_len:
            # (every request failed, and the hint blamed the prompts: --input-len could not help)
            raise ValueError(f"output_len {cfg.output_len} leaves no room for a prompt in the server's max_model_len "
                             f"{info.max_model_len}; lower --output-len")

        def tokenize(text: str) -> List[int]:
            # pieces glued into token prompts: no special tokens (as bench_inprocess' tokenizer.encode)
            r = client.post(base_url + "/tokenize", json={"prompt": text, "add_special_tokens": False})
            r.raise_for_status()
            return r.json()["tokens"]

        from mtpspec.entrypoints.bench_dataset import build_prompts
        prompts = build_prompts(cfg.prompts, cfg.num_prompts + cfg.warmup, cfg.input_len, info.vocab_size, tokenize,
                                cfg.dataset, cfg.seed)
        warm, prompts = prompts[:cfg.warmup], prompts[cfg.warmup:]
        client.post(base_url + "/reset_prefix_cache")  # a run starts cold (older servers: 404, ignored)
        if warm:
            wcfg = replace(cfg, num_prompts=len(warm), output_len=cfg.warmup_output_len or cfg.output_len,
                           request_rate=math.inf)  # never paced
            asyncio.run(_run_load(base_url, info.model, warm, wcfg, False, "warmup"))
        before = scrape(base_url, client)
        started_at = time.time()
        t0 = time.perf_counter()
        recs = asyncio.run(_run_load(base_url, info.model, prompts, cfg, progress, desc))
        duration = time.perf_counter() - t0
        after = scrape(base_url, client)
    ok = [r for r in recs if r.ok]
    if not ok:
        first = str(recs[0].error) if recs else "none"
        hint = ""
        if cfg.input_len is None and ("max_model_len" in first or "maximum context length" in first):
            hint = (f"; the natural GSM8K 5-shot prompts do not fit the server's max_model_len {info.max_model_len}: "
                    "pass --input-len N (prompts of exactly N tokens, N + --output-len <= max_model_len)")
        raise ValueError(f"no request succeeded; first error: {first}{hint}")
    k = int(info.info.get("num_speculative_tokens") or 0)
    spec = spec_figures(before, after, k)
    out_tokens = sum(r.output_tokens for r in ok)
    out_tps = out_tokens / duration
    acc = spec["acceptance_length"]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1 and r.ttft is not None]
    reasons = []
    if cfg.prompts == "random":
        reasons.append("random-token prompts")
    if cfg.ignore_eos:
        reasons.append("ignore_eos")
    if info.forced_acceptance:
        reasons.append(f"forced acceptance {info.forced_acceptance}")
    return {
        "synthetic": bool(reasons), "synthetic_reasons": reasons,
        "server": {"base_url": base_url, "model": info.model, "max_model_len": info.max_model_len, **info.info},
        "config": cfg.as_json(), "started_at": started_at,
        "duration_s": duration, "completed": len(ok), "failed": len(recs) - len(ok),
        "errors": sorted({r.error for r in recs if not r.ok})[:5],
        "total_input_tokens": sum(r.input_tokens for r in ok), "total_output_tokens": out_tokens,
        "mean_output_len": out_tokens / len(ok),
        "request_throughput": len(ok) / duration, "output_throughput": out_tps,
        "ttft_ms": _ms([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _ms([g for r in ok for g in r.chunk_gaps]),
        "tpot_ms": _ms(tpots),
        "steps_per_s": out_tps / (acc if acc else 1.0),
        "engine_steps_per_s": spec["engine_steps"] / duration,
        **spec,
    }


# ---------------------------------------------------------------------------- report
def _f(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def format_rate(config: Dict[str, Any]) -> str:
    """A run config's (:meth:`BenchConfig.as_json`) arrivals: ``inf (all at once)`` or
    ``4 req/s, burstiness 1 (Poisson)``."""
    rate, b = config.get("request_rate", "inf"), config.get("burstiness", 1.0)
    if rate in ("inf", math.inf):
        return "inf (all at once)"
    return f"{rate:g} req/s, burstiness {b:g}" + (" (Poisson)" if b == 1 else "")


def format_result(res: Dict[str, Any]) -> str:
    """A compact table of one run (SYNTHETIC runs say so in the title)."""
    title = "mtpspec bench serve"
    if res["synthetic"]:
        title += "   [SYNTHETIC: " + ", ".join(res["synthetic_reasons"]) + "]"
    s = res["server"]
    arm = f"k={s.get('num_speculative_tokens')} fusion={s.get('fusion')} local_argmax={s.get('local_argmax')} tp={s.get('tp')}"
    c = res["config"]
    rates = ", ".join(_f(r, ".3f") for r in res["acceptance_rate_per_pos"]) or "-"
    comm = ", ".join(f"{op} {b:,.0f}" for op, b in res["collective_bytes_per_step"].items()) or "0"
    lines = [
        "=" * 72, title, "=" * 72,
        f"server                      {s.get('model')}  ({arm})",
        f"workload                    {res['completed']} ok / {res['failed']} failed, concurrency {c['max_concurrency']}, "
        f"in {c['input_len'] or 'natural'}, out {c['output_len']}, prompts {c['prompts']}",
        f"request rate                {format_rate(c)}",
        f"duration                    {res['duration_s']:.2f} s",
        f"request throughput          {res['request_throughput']:.2f} req/s  (completed)",
        f"input / output tokens       {res['total_input_tokens']} / {res['total_output_tokens']}  "
        f"(mean out {res['mean_output_len']:.1f})",
        f"output throughput           {res['output_throughput']:.2f} tok/s",
        f"acceptance length           {_f(res['acceptance_length'], '.3f')}",
        f"steps proposing k = 0..     {res.get('num_speculative_tokens_histogram') or '-'}",
        f"acceptance rate per pos     [{rates}]",
        f"steps/s (tok/s / acc. len)  {res['steps_per_s']:.2f}   (engine steps/s {res['engine_steps_per_s']:.2f})",
        f"TTFT median / p99           {_f(res['ttft_ms']['median'])} / {_f(res['ttft_ms']['p99'])} ms",
        f"ITL  median / p99           {_f(res['itl_ms']['median'])} / {_f(res['itl_ms']['p99'])} ms  (per chunk)",
        f"TPOT median / p99           {_f(res['tpot_ms']['median'])} / {_f(res['tpot_ms']['p99'])} ms",
        f"collective bytes / step     {comm}  (rank 0)",
        f"prefix cache hit rate       {_f(res.get('prefix_cache_hit_rate'), '.3f')}",
        "=" * 72,
    ]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Workload options shared by ``bench serve`` and ``bench arms``."""
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per run (default: bench serve 64, with --shared-prefix 32 miss / hit pairs; "
                        "bench arms: the workload's)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (default: bench serve 8, with --request-rate no limit; bench arms: "
                        "the workload's; --shared-prefix sends one at a time)")
    p.add_argument("--input-len", type=int, default=None,
                   help="prompt tokens (default: natural GSM8K 5-shot prompts; 1024 for random prompts)")
    p.add_argument("--output-len", type=int, default=None,
                   help="max_tokens per request (default: bench serve 256, with --shared-prefix 8; bench arms: the "
                        "workload's)")
    p.add_argument("--dataset", default=None,
                   help="GSM8K JSONL file, or a folder with test.jsonl, for prompts (default: $MTPSPEC_GSM8K_DIR, "
                        "else the GSM8K test split bundled in mtpspec/data/gsm8k)")
    p.add_argument("--random-prompts", action="store_true", help="random token ids (SYNTHETIC: distorts acceptance)")
    p.add_argument("--request-rate", type=float, default=math.inf, metavar="R",
                   help="arrivals per second: request i is sent at its arrival time, the gaps drawn (seeded by "
                        "--seed) from a gamma distribution of shape --burstiness and mean 1/R, scaled so that the "
                        "last arrives at num-prompts / R (vLLM's rule); an arrival finding --max-concurrency "
                        "requests in flight waits for one (both limits apply). bench serve: R without "
                        "--max-concurrency has no concurrency limit; bench arms: every workload's timed runs at R, "
                        "its concurrency still the limit (refused with --in-process, which queues every request "
                        "at once). Warm-ups are not paced (default inf: all at once, only --max-concurrency limits)")
    p.add_argument("--burstiness", type=float, default=1.0, metavar="B",
                   help="shape of the gamma distribution of --request-rate's gaps: 1 Poisson arrivals, below 1 "
                        "burstier, above 1 more regular; finite > 0, only with --request-rate (default 1)")
    vllm = p.add_argument_group("vLLM's spellings (vllm bench serve)", "the same options as above; both spellings "
                                "of one option with different values are an error")
    vllm.add_argument("--dataset-name", choices=("gsm8k", "random"), default=None,
                      help="random: --random-prompts; gsm8k: GSM8K prompts (mtpspec's default; vLLM's is random)")
    vllm.add_argument("--dataset-path", default=None, metavar="PATH", help="--dataset")
    vllm.add_argument("--random-input-len", type=int, default=None, metavar="N", help="--input-len")
    vllm.add_argument("--random-output-len", type=int, default=None, metavar="N", help="--output-len")
    p.add_argument("--ignore-eos", action="store_true", help="generate output-len tokens regardless of EOS (SYNTHETIC)")
    p.add_argument("--temperature", type=float, default=0.0, help="every request's (default 0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts' selection, request i's sampling "
                   "(seed + i) and --request-rate's arrivals (default 0)")
    p.add_argument("--no-request-seeds", dest="request_seeds", action="store_false",
                   help="send requests without a seed of their own (under adaptive speculation a seeded request "
                        "keeps argmax drafts: docs/serving.md)")
    p.add_argument("--warmup", type=int, default=None,
                   help="unmeasured requests before each run, at most --max-concurrency at a time (default 1; "
                        "bench arms: two waves of the workload's concurrency, 16 tokens each, so that each "
                        "arm's server has compiled the workload's kernel shapes before the timed run)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="load generator against a running mtpspec serve", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    add_arguments(p)
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    p.add_argument("--shared-prefix", action="store_true",
                   help="prefix-cache TTFT: GSM8K few-shot prompts sharing one few-shot prefix, one request at "
                        "a time in pairs: the server's prefix cache emptied (POST /reset_prefix_cache), then a "
                        "miss (computed whole) and a hit (the next question, prefix cached); reports TTFT of each "
                        "and hit / miss (defaults: 32 of each, output-len 8)")
    p.add_argument("--num-shots", type=int, default=5, help="solved examples per prompt with --shared-prefix (default 5)")
    from mtpspec.entrypoints.bench_interference import add_arguments as add_interference_arguments
    add_interference_arguments(p)


#: :class:`BenchConfig` fields set from a ``bench serve`` flag of the same name: their errors name the flag
FLAG_FIELDS = ("num_prompts", "max_concurrency", "input_len", "output_len", "warmup", "temperature", "request_rate",
               "burstiness")
#: vLLM's spellings of ``bench serve`` options: the alias' dest -> the option's (``--dataset-name``: :func:`_prompts`)
ALIASES = {"dataset_path": "dataset", "random_input_len": "input_len", "random_output_len": "output_len"}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _given(args: argparse.Namespace, dest: str) -> Any:
    """``dest``'s value, from its flag or its vLLM spelling (``None``: neither given).

    Raises:
        ValueError: both spellings given, with different values."""
    value = getattr(args, dest)
    alias = next((a for a, d in ALIASES.items() if d == dest), None)
    other = getattr(args, alias, None) if alias else None
    if value is not None and other is not None and value != other:
        raise ValueError(f"{_flag(dest)} {value} and {_flag(alias)} {other} disagree ({_flag(alias)} is vLLM's "
                         f"spelling of {_flag(dest)}); give one")
    return other if value is None else value


def _prompts(args: argparse.Namespace) -> str:
    """``"random"`` or ``"gsm8k"``, from ``--random-prompts`` / ``--dataset-name``.

    Raises:
        ValueError: ``--random-prompts`` with ``--dataset-name gsm8k``."""
    name = getattr(args, "dataset_name", None)
    if args.random_prompts and name == "gsm8k":
        raise ValueError("--random-prompts and --dataset-name gsm8k disagree (--dataset-name random is vLLM's "
                         "spelling of --random-prompts); give one")
    return "random" if args.random_prompts else name or "gsm8k"


def config_from_args(args: argparse.Namespace, defaults: Dict[str, Any]) -> BenchConfig:
    """The :class:`BenchConfig` of ``bench serve`` / ``bench arms`` flags, ``defaults`` for those not given
    (a ``max_concurrency`` of ``None``: no limit, ``num_prompts``).

    Raises:
        ValueError: :class:`BenchConfig`'s, naming the flag (``--num-prompts must be an int >= 1, got 0``)
            where the field is one of :data:`FLAG_FIELDS`; both spellings of an option (:data:`ALIASES`) with
            different values; ``--burstiness`` without ``--request-rate``.
    """
    def pick(name: str) -> Any:
        value = _given(args, name)
        return defaults.get(name) if value is None else value

    kw = dict(num_prompts=pick("num_prompts"), max_concurrency=pick("max_concurrency"), input_len=pick("input_len"),
              output_len=pick("output_len"), prompts=_prompts(args), dataset=_given(args, "dataset"),
              ignore_eos=args.ignore_eos, temperature=args.temperature, seed=args.seed,
              request_seeds=args.request_seeds,
              warmup=args.warmup if args.warmup is not None else defaults.get("warmup", 1),
              warmup_output_len=defaults.get("warmup_output_len") if args.warmup is None else None,
              request_rate=args.request_rate, burstiness=args.burstiness)
    conc, n = kw["max_concurrency"], kw["num_prompts"]
    kw["max_concurrency"] = n if conc is None else min(conc, n)
    try:
        cfg = BenchConfig(**kw)
    except ValueError as exc:
        msg = str(exc)
        field = next((f for f in FLAG_FIELDS if msg.startswith(f + " ")), None)
        if field is None:
            raise
        raise ValueError(_flag(field) + msg[len(field):]) from None
    if cfg.burstiness != 1.0 and cfg.request_rate == math.inf:  # (vLLM ignores it silently)
        raise ValueError(f"--burstiness {cfg.burstiness:g} shapes the gaps between --request-rate's arrivals; "
                         "give a --request-rate (default inf: all at once, no gaps)")
    return cfg


#: ``bench serve`` options each other workload does not read: ``--prefill-interference`` builds its own random
#: prompts and lengths (its own flags); ``--shared-prefix`` sends GSM8K few-shot text, greedy, seeded per request.
#: Neither paces by --request-rate: --shared-prefix sends one request at a time, --prefill-interference at its own.
UNREAD_BY = {"prefill_interference": ("num_prompts", "max_concurrency", "input_len", "random_input_len", "output_len",
                                      "random_output_len", "dataset", "dataset_path", "random_prompts",
                                      "dataset_name", "ignore_eos", "request_seeds", "request_rate", "burstiness"),
             "shared_prefix": ("input_len", "random_input_len", "random_prompts", "dataset_name", "ignore_eos",
                               "temperature", "request_seeds", "request_rate", "burstiness")}


def unread_flags(args: argparse.Namespace) -> List[str]:
    """The ``bench serve`` options given (``--flag-name``) that the chosen ``--prefill-interference`` /
    ``--shared-prefix`` workload would ignore (:data:`UNREAD_BY`); empty for the default workload. An option
    at its default value passes (``--temperature 0``; ``--dataset-name gsm8k`` with ``--shared-prefix``)."""
    unset = {"random_prompts": (False,), "ignore_eos": (False,), "temperature": (0.0,), "request_seeds": (True,),
             "request_rate": (math.inf,), "burstiness": (1.0,),
             "dataset_name": (None, "gsm8k") if getattr(args, "shared_prefix", False) else (None,)}
    spelled = {"request_seeds": "--no-request-seeds"}
    for workload, names in UNREAD_BY.items():
        if getattr(args, workload, False):
            return [spelled.get(n, _flag(n)) for n in names if getattr(args, n, None) not in unset.get(n, (None,))]
    return []


def run(args: argparse.Namespace) -> int:
    from mtpspec.entrypoints import bench_interference
    misplaced = bench_interference.misplaced_flags(args)
    if misplaced:
        print(f"error: {', '.join(misplaced)} apply only with --prefill-interference", file=sys.stderr)
        return 2
    if args.shared_prefix and args.prefill_interference:
        print("error: --shared-prefix and --prefill-interference are two workloads; pick one", file=sys.stderr)
        return 2
    unread = unread_flags(args)
    if unread:  # (they were ignored, silently)
        workload = "--prefill-interference" if args.prefill_interference else "--shared-prefix"
        print(f"error: {workload} ignores {', '.join(unread)}; drop {'it' if len(unread) == 1 else 'them'}"
              + (" (its own flags: --num-decodes, --decode-input-len, --prefill-input-len, ...: --help)"
                 if args.prefill_interference else ""), file=sys.stderr)
        return 2
    why = output_path_problem(args.json)
    if why is not None:
        print(f"error: --json: {why}", file=sys.stderr)
        return 2
    try:
        if args.prefill_interference:
            icfg = bench_interference.config_from_args(args)
            res = bench_interference.run_interference_benchmark(args.base_url, icfg, progress=not args.no_progress)
            print(bench_interference.format_interference_result(res))
        elif args.shared_prefix:
            from mtpspec.entrypoints.bench_prefix import format_prefix_result, run_prefix_benchmark
            if args.max_concurrency not in (None, 1):
                raise ValueError(f"--max-concurrency {args.max_concurrency}: --shared-prefix sends one request at a "
                                 "time (TTFT without queueing); drop it")
            cfg = config_from_args(args, {"num_prompts": 32, "max_concurrency": 1, "output_len": 8})
            res = run_prefix_benchmark(args.base_url, cfg, args.num_shots)
            print(format_prefix_result(res))
        else:
            cfg = config_from_args(args, {"num_prompts": 64, "output_len": 256,  # a rate alone: no limit (vLLM's)
                                          "max_concurrency": 8 if args.request_rate == math.inf else None})
            res = run_benchmark(args.base_url, cfg, progress=not args.no_progress)
            print(format_result(res))
    except httpx.TransportError as exc:
        print(f"error: cannot reach the server at {args.base_url}: {exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0

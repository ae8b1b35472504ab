"""`mtpspec bench serve --prefill-interference`: ITL of running decodes while long prompts are prefilled.

Issue 17's chunked-prefill goal: with 4 clients sending 8,192-token prompts into 60 running
decodes, the running requests' ITL p99 stays within 2x of their median (without chunked
prefill, one step computes a whole prompt and every running request stalls for it).

Workload, against a running ``mtpspec serve`` (nobody else should use it meanwhile):

1. ``POST /reset_prefix_cache``; ``num_decodes`` streaming decodes start: short distinct
   random-token prompts (``decode_input_len``), ``ignore_eos`` and ``max_tokens =
   decode_output_len`` (default: as long as the context allows), so they keep running. The
   client waits until every one has streamed a token.
2. Warm-up: ``warmup`` unmeasured long prompts, one at a time, into the running decodes (the
   first mixed decode + chunk steps compile their kernels).
3. Baseline: ``baseline_s`` seconds of decoding alone.
4. Interference: ``num_prefill_clients`` clients each send ``prefill_requests`` long prompts
   one after the other (``prefill_input_len`` distinct random token ids, so the prefix cache
   cannot serve them; ``max_tokens = prefill_output_len``). The window runs from the first
   send to the last long request's end.
5. The decodes are cancelled (the server aborts them) and the client waits until the server
   runs nothing.

Measured on the client: every decode's chunk arrival times, read by ``client_procs`` worker
processes (one per 15 decodes by default) so that the client's own per-chunk work does not
delay what it records; each also measures its event loop's lag (how late a 2 ms sleep wakes),
reported per window and warned about when its p99 exceeds a quarter of the ITL median. ITL is the gap between a decode's
consecutive chunks (one chunk per engine step that emitted tokens; under speculation a chunk
may hold several tokens), as in ``bench serve``. A gap belongs to the *baseline* when it lies
wholly inside the baseline window, to the *interference* window when it overlaps it at all
(a gap that straddles the first send counts there: the stall may have begun inside it); gaps
before the baseline and after the window are not used (:func:`split_itl`). Reported per
window: count, median, p90, p99, max (ms) (:func:`itl_stats`), the decodes' tokens/s, the
engine steps (``/metrics`` deltas); over the interference window the ratio p99 / median and
whether issue 17's goal holds (ratio <= 2, :func:`goal_verdict`); the long prompts' TTFT.
Problems that make a run unfit to judge (decodes that ended or failed before the window did,
preemptions, prefix-cache hits on the long prompts, no baseline samples, client lag) are listed
as warnings. Prompts are random token ids and the decodes ignore EOS: every result is SYNTHETIC.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import httpx

from mtpspec.entrypoints.bench_serve import api_key_headers

#: issue 17: interference-window ITL p99 at most this many times its median
GOAL_RATIO = 2.0
#: a window's client event-loop lag p99 above this fraction of its ITL median is reported
CLIENT_LAG_LIMIT = 0.25


@dataclass
class InterferenceConfig:
    """One run's workload (module docstring).

    Attributes:
        num_decodes: running streaming decodes.
        decode_input_len: prompt tokens of each decode.
        decode_output_len: ``max_tokens`` of each decode (``None``: ``max_model_len -
            decode_input_len``); they must outlast the run, which cancels them at its end.
        num_prefill_clients: clients sending long prompts at the same time.
        prefill_requests: long prompts per client, one after the other.
        prefill_input_len: tokens of each long prompt.
        prefill_output_len: ``max_tokens`` of each long prompt.
        baseline_s: seconds of decoding alone before the long prompts.
        warmup: unmeasured long prompts sent (one at a time) before the baseline.
        temperature, seed: sampling of every request (request ``i`` gets ``seed + i``) and
            the random prompts.
        ready_timeout_s: most seconds to wait for every decode to stream.
        client_procs: processes reading the decode streams (``None``: one per 15 decodes), so
            the client's own work does not delay the arrival times it records.
    """

    num_decodes: int = 60
    decode_input_len: int = 32
    decode_output_len: Optional[int] = None
    num_prefill_clients: int = 4
    prefill_requests: int = 2
    prefill_input_len: int = 8192
    prefill_output_len: int = 4
    baseline_s: float = 3.0
    warmup: int = 1
    temperature: float = 0.0
    seed: int = 0
    ready_timeout_s: float = 600.0
    client_procs: Optional[int] = None

    def __post_init__(self) -> None:
        if self.client_procs is None:
            self.client_procs = max(1, -(-self.num_decodes // 15)) if isinstance(self.num_decodes, int) else 1
        for name in ("num_decodes", "decode_input_len", "num_prefill_clients", "prefill_requests",
                     "prefill_input_len", "prefill_output_len", "client_procs"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.decode_output_len is not None and (not isinstance(self.decode_output_len, int)
                                                   or self.decode_output_len < 2):
            raise ValueError(f"decode_output_len must be an int >= 2 or None, got {self.decode_output_len!r}")
        if not self.baseline_s > 0:
            raise ValueError(f"baseline_s must be > 0, got {self.baseline_s!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {self.warmup!r}")


# ---------------------------------------------------------------------------- statistics
def split_itl(chunk_times: Sequence[Sequence[float]], baseline: Tuple[float, float],
              window: Tuple[float, float]) -> Tuple[List[float], List[float]]:
    """``(baseline gaps, interference gaps)`` in seconds from each stream's chunk arrival times.

    A gap ``(a, b)`` between consecutive chunks of one stream is a baseline gap when
    ``baseline[0] <= a`` and ``b <= baseline[1]`` (wholly inside), an interference gap when
    ``a < window[1]`` and ``b > window[0]`` (any overlap). The windows must not overlap.

    Raises:
        ValueError: a window ends before it starts, or the baseline ends after the window starts.
    """
    (b0, b1), (w0, w1) = baseline, window
    if b1 < b0 or w1 < w0 or b1 > w0:
        raise ValueError(f"windows must be ordered: baseline {baseline}, interference {window}")
    base: List[float] = []
    inter: List[float] = []
    for times in chunk_times:
        for a, b in zip(times, times[1:]):
            if b < a:
                raise ValueError("chunk times of a stream must not decrease")
            if b0 <= a and b <= b1:
                base.append(b - a)
            if a < w1 and b > w0:
                inter.append(b - a)
    return base, inter


def _pct(xs: Sequence[float], q: float) -> Optional[float]:
    from mtpspec.entrypoints.bench_serve import _pct as pct
    return pct(xs, q)


def itl_stats(gaps_s: Sequence[float]) -> Dict[str, Any]:
    """``count`` and ``median`` / ``p90`` / ``p99`` / ``max`` / ``mean`` in ms (``None`` when empty);
    percentiles linearly interpolated (numpy's default)."""
    ms = [g * 1000.0 for g in gaps_s]
    return {"count": len(ms), "median": _pct(ms, 50), "p90": _pct(ms, 90), "p99": _pct(ms, 99),
            "max": max(ms) if ms else None, "mean": statistics.fmean(ms) if ms else None}


def goal_verdict(stats: Dict[str, Any], limit: float = GOAL_RATIO) -> Dict[str, Any]:
    """Issue 17's rule on interference-window statistics: ``p99 / median <= limit``.

    Returns ``{"ratio", "limit", "met"}``; ``ratio`` and ``met`` are ``None`` without samples.
    """
    med, p99 = stats.get("median"), stats.get("p99")
    if not med or p99 is None:
        return {"ratio": None, "limit": limit, "met": None}
    ratio = p99 / med
    return {"ratio": ratio, "limit": limit, "met": ratio <= limit}


def tokens_in(chunks: Sequence[Sequence[Tuple[float, int]]], t0: float, t1: float) -> int:
    """Tokens of the chunks that arrived in ``[t0, t1]`` (all streams)."""
    return sum(n for s in chunks for t, n in s if t0 <= t <= t1)


# ---------------------------------------------------------------------------- checks before a run
def derived_batched_tokens(info: Dict[str, Any], max_model_len: int) -> int:
    """The server's ``max_num_batched_tokens`` (its default when ``/v1/models`` says "derived")."""
    v = info.get("max_num_batched_tokens")
    if isinstance(v, int):
        return v
    rows = int(info.get("max_num_seqs") or 0) * (1 + int(info.get("num_speculative_tokens") or 0))
    if info.get("enable_chunked_prefill", True):
        return max(min(max_model_len, 2048), rows)
    return max(max_model_len, rows)


def check_fits(cfg: InterferenceConfig, max_model_len: int, info: Dict[str, Any]) -> int:
    """Check the workload fits the server; returns the decodes' ``max_tokens``.

    Raises:
        ValueError: a prompt + its output above ``max_model_len``; fewer sequences per step
            (``max_num_seqs``) than decodes + prefill clients (the long prompts would wait for
            decodes that never end); without chunked prefill, a step budget too small for a
            whole long prompt next to the decodes' rows (it would wait until they end).
    """
    if max_model_len:
        need = cfg.prefill_input_len + cfg.prefill_output_len
        if need > max_model_len:
            raise ValueError(f"prefill-input-len {cfg.prefill_input_len} + prefill-output-len "
                             f"{cfg.prefill_output_len} exceed the server's max_model_len {max_model_len}; lower "
                             "them or serve a model with more positions at a larger --max-model-len")
    out_len = cfg.decode_output_len
    if out_len is None:
        if not max_model_len:
            raise ValueError("the server does not report max_model_len: pass --decode-output-len")
        out_len = max_model_len - cfg.decode_input_len
    if out_len < 2 or (max_model_len and cfg.decode_input_len + out_len > max_model_len):
        raise ValueError(f"decode-input-len {cfg.decode_input_len} + decode-output-len {out_len} do not fit the "
                         f"server's max_model_len {max_model_len}")
    seqs = int(info.get("max_num_seqs") or 0)
    if seqs and seqs < cfg.num_decodes + cfg.num_prefill_clients:
        raise ValueError(f"the server runs at most {seqs} sequences per step (--max-num-seqs) but the workload needs "
                         f"{cfg.num_decodes} decodes + {cfg.num_prefill_clients} prefill clients = "
                         f"{cfg.num_decodes + cfg.num_prefill_clients}; lower --num-decodes or raise --max-num-seqs")
    if info and not info.get("enable_chunked_prefill", True):
        budget = derived_batched_tokens(info, max_model_len)
        rows = cfg.num_decodes * (1 + int(info.get("num_speculative_tokens") or 0))
        if rows + cfg.prefill_input_len > budget:
            raise ValueError(f"without chunked prefill a {cfg.prefill_input_len}-token prompt waits until it fits one "
                             f"step next to the decodes' {rows} rows, but the server's step budget is {budget} tokens; "
                             f"serve with --max-num-batched-tokens >= {rows + cfg.prefill_input_len}")
    return out_len


# ---------------------------------------------------------------------------- load
@dataclass
class StreamRecord:
    """One streaming request on the client (``time.perf_counter`` seconds)."""

    sent: float = 0.0
    chunks: List[Tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) of chunks with tokens
    finished_at: Optional[float] = None  # a finish reason arrived
    done_at: Optional[float] = None  # the response ended
    prompt_tokens: int = 0
    error: str = ""

    @property
    def ttft(self) -> Optional[float]:
        return self.chunks[0][0] - self.sent if self.chunks else None


async def _stream(client: httpx.AsyncClient, url: str, body: Dict[str, Any], rec: StreamRecord) -> None:
    rec.sent = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.error = chunk["error"].get("message", "error")
                    return
                if chunk.get("usage"):
                    rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                for ch in chunk.get("choices", []):
                    if ch.get("token_ids"):
                        rec.chunks.append((now, len(ch["token_ids"])))
                    if ch.get("finish_reason") is not None and rec.finished_at is None:
                        rec.finished_at = now
        rec.done_at = time.perf_counter()
        if not rec.chunks:
            rec.error = "no tokens streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"


def _body(model: str, prompt: List[int], max_tokens: int, cfg: InterferenceConfig, seed: int,
          ignore_eos: bool) -> Dict[str, Any]:
    from mtpspec.entrypoints.bench_serve import NEUTRAL_SAMPLING
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": cfg.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos, "seed": seed,
            "return_token_ids": True, **NEUTRAL_SAMPLING}


async def _metrics(client: httpx.AsyncClient, url: str) -> Dict[str, float]:
    from mtpspec.entrypoints.bench_serve import parse_metrics
    return parse_metrics((await client.get(url + "/metrics")).text)


# Decode streams are read by worker processes (``client_procs``), each with its own event loop,
# so that the client's per-chunk work (about 50-100 us of Python per chunk) does not delay the
# arrival times it records: 60 decodes at a few ms per step are 10,000+ chunks per second.
# ``time.perf_counter`` is CLOCK_MONOTONIC on Linux, one clock for every process.
LAG_PERIOD_S = 0.002  # the loop-lag probe's sleep


async def _lag_probe(samples: List[Tuple[float, float]]) -> None:
    """``(time, lag)``: how late a ``LAG_PERIOD_S`` sleep wakes up (the loop's own delay)."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(LAG_PERIOD_S)
        now = time.perf_counter()
        samples.append((now, now - t - LAG_PERIOD_S))


async def _decode_worker_async(url: str, bodies: List[Dict[str, Any]], conn: Any) -> None:
    n = len(bodies) + 4
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    recs = [StreamRecord() for _ in bodies]
    lags: List[Tuple[float, float]] = []
    async with httpx.AsyncClient(headers=api_key_headers(), timeout=httpx.Timeout(3600.0), limits=limits) as client:
        tasks = [asyncio.ensure_future(_stream(client, url, body, rec)) for body, rec in zip(bodies, recs)]
        probe = asyncio.ensure_future(_lag_probe(lags))
        try:
            while not all(r.chunks for r in recs):
                bad = [r.error or "ended" for r, t in zip(recs, tasks) if t.done() and not r.chunks]
                if bad or conn.poll():
                    conn.send(("error", f"a decode request failed before streaming: {bad[0]}" if bad else "stopped"))
                    return
                await asyncio.sleep(0.005)
            conn.send(("ready", time.perf_counter()))
            while not conn.poll():
                await asyncio.sleep(0.01)
            conn.recv()
        finally:
            for t in tasks + [probe]:
                t.cancel()
            await asyncio.gather(*tasks, probe, return_exceptions=True)
    conn.send(("records", [asdict(r) for r in recs], lags))


def _decode_worker(url: str, bodies: List[Dict[str, Any]], conn: Any) -> None:
    """A client process: streams ``bodies``, says ``("ready", t)`` once each streamed a token,
    and on any message cancels them and sends back ``("records", [StreamRecord as dict], lags)``."""
    try:
        asyncio.run(_decode_worker_async(url, bodies, conn))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        try:
            conn.send(("error", f"client process: {type(exc).__name__}: {exc}"))
        except OSError:
            pass


async def _recv(conn: Any, deadline: float) -> Tuple[Any, ...]:
    while not conn.poll():
        if time.perf_counter() > deadline:
            raise ValueError("a client process did not answer in time")
        await asyncio.sleep(0.005)
    return conn.recv()


async def _run(url: str, model: str, cfg: InterferenceConfig, decode_len: int, decode_prompts: List[List[int]],
               warm_prompts: List[List[int]], prefill_prompts: List[List[int]], say: Any) -> Dict[str, Any]:
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    n_conn = cfg.num_prefill_clients + 8
    limits = httpx.Limits(max_connections=n_conn, max_keepalive_connections=n_conn)
    async with httpx.AsyncClient(headers=api_key_headers(), timeout=httpx.Timeout(3600.0), limits=limits) as client:
        r = await client.post(url + "/reset_prefix_cache")
        if r.status_code != 200:
            raise ValueError(f"POST /reset_prefix_cache answered HTTP {r.status_code}: {r.text[:200]}")
        bodies = [_body(model, p, decode_len, cfg, cfg.seed + i, True) for i, p in enumerate(decode_prompts)]
        nproc = min(cfg.client_procs, len(bodies))
        say(f"phase 1: {len(bodies)} decodes starting ({nproc} client processes)")
        t0 = time.perf_counter()
        workers = []
        for w in range(nproc):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_decode_worker, args=(url, bodies[w::nproc], child), daemon=True)
            proc.start()
            workers.append((proc, parent))
        replies: List[Tuple[Any, ...]] = []
        try:
            deadline = time.perf_counter() + cfg.ready_timeout_s
            for _, conn in workers:
                msg = await _recv(conn, deadline)
                if msg[0] != "ready":
                    raise ValueError(msg[1])
            t_ready = time.perf_counter()
            warm = []
            for i, p in enumerate(warm_prompts):
                say(f"warm-up: long prompt {i + 1} of {len(warm_prompts)}")
                rec = StreamRecord()
                await _stream(client, url, _body(model, p, cfg.prefill_output_len, cfg, cfg.seed + 10_000 + i,
                                                 False), rec)
                if rec.error:
                    raise ValueError(f"warm-up long prompt failed: {rec.error}")
                warm.append(rec)
            m_base = await _metrics(client, url)
            t_base = time.perf_counter()
            say(f"phase 2: baseline, {cfg.baseline_s:g} s of decoding alone")
            await asyncio.sleep(cfg.baseline_s)
            m_start = await _metrics(client, url)
            t_start = time.perf_counter()
            say(f"phase 3: {cfg.num_prefill_clients} clients x {cfg.prefill_requests} prompts of "
                f"{cfg.prefill_input_len} tokens")

            async def prefill_client(c: int) -> List[StreamRecord]:
                out = []
                for j in range(cfg.prefill_requests):
                    i = c * cfg.prefill_requests + j
                    rec = StreamRecord()
                    await _stream(client, url, _body(model, prefill_prompts[i], cfg.prefill_output_len, cfg,
                                                     cfg.seed + 20_000 + i, False), rec)
                    out.append(rec)
                return out

            per_client = await asyncio.gather(*(prefill_client(c) for c in range(cfg.num_prefill_clients)))
            t_end = time.perf_counter()
            m_end = await _metrics(client, url)
        finally:
            for _, conn in workers:  # stop: every worker cancels its decodes and reports
                try:
                    conn.send(("stop",))
                except OSError:
                    pass
            deadline = time.perf_counter() + 60.0
            for proc, conn in workers:
                try:
                    replies.append(await _recv(conn, deadline))
                except (ValueError, EOFError, OSError):
                    replies.append(("error", "no records"))
            for proc, _ in workers:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
        bad = [m[1] for m in replies if m[0] != "records"]
        if bad:
            raise ValueError(f"a client process failed: {bad[0]}")
        decodes: List[StreamRecord] = []
        lags: List[Tuple[float, float]] = []
        for m in replies:
            decodes += [StreamRecord(**{**d, "chunks": [tuple(c) for c in d["chunks"]]}) for d in m[1]]
            lags += [tuple(x) for x in m[2]]
        say("decodes cancelled; waiting for the server to drain")
        drained = False
        deadline = time.perf_counter() + 30.0
        while time.perf_counter() < deadline:
            m = await _metrics(client, url)
            if m.get("mtpspec:num_requests_running", 0.0) == 0 and m.get("mtpspec:num_requests_waiting", 0.0) == 0:
                drained = True
                break
            await asyncio.sleep(0.1)
    return {"t0": t0, "t_ready": t_ready, "t_base": t_base, "t_start": t_start, "t_end": t_end, "decodes": decodes,
            "lags": lags, "warm": warm,
            "prefills": [(c, j, rec) for c, recs in enumerate(per_client) for j, rec in enumerate(recs)],
            "metrics": (m_base, m_start, m_end), "drained": drained}


def run_interference_benchmark(base_url: str, cfg: InterferenceConfig, progress: bool = True) -> Dict[str, Any]:
    """Run the workload (module docstring) against ``base_url``; returns every figure.

    Raises:
        ValueError: the workload does not fit the server (:func:`check_fits`), a decode failed
            or did not start streaming, or a long prompt failed.
        httpx.HTTPError: the server cannot be reached.
    """
    from mtpspec.entrypoints.bench_dataset import random_prompts
    from mtpspec.entrypoints.bench_serve import ServerInfo, server_root
    base_url = server_root(base_url)
    with httpx.Client(headers=api_key_headers(), timeout=60.0) as client:
        info = ServerInfo(base_url, client)
    decode_len = check_fits(cfg, info.max_model_len, info.info)
    n_long = cfg.warmup + cfg.num_prefill_clients * cfg.prefill_requests
    decode_prompts = random_prompts(cfg.num_decodes, cfg.decode_input_len, info.vocab_size, cfg.seed)
    long_prompts = random_prompts(n_long, cfg.prefill_input_len, info.vocab_size, cfg.seed + 1)
    if len({tuple(p[:64]) for p in long_prompts}) < n_long:  # distinct from their first block on
        raise ValueError("random long prompts collide; change --seed")

    def say(msg: str) -> None:
        if progress:
            print(f"[prefill-interference] {msg}", file=sys.stderr, flush=True)

    raw = asyncio.run(_run(base_url, info.model, cfg, decode_len, decode_prompts, long_prompts[:cfg.warmup],
                           long_prompts[cfg.warmup:], say))
    return summarise(raw, cfg, info, decode_len, base_url)


def summarise(raw: Dict[str, Any], cfg: InterferenceConfig, info: Any, decode_len: int,
              base_url: str = "") -> Dict[str, Any]:
    """The figures of one run from :func:`_run`'s raw timings (times relative to the first decode's send)."""
    t0, t_base, t_start, t_end = raw["t0"], raw["t_base"], raw["t_start"], raw["t_end"]
    decodes: List[StreamRecord] = raw["decodes"]
    times = [[t for t, _ in d.chunks] for d in decodes]
    base_gaps, inter_gaps = split_itl(times, (t_base, t_start), (t_start, t_end))
    base, inter = itl_stats(base_gaps), itl_stats(inter_gaps)
    verdict = goal_verdict(inter)
    chunks_in = [sum(1 for a, b in zip(ts, ts[1:]) if a < t_end and b > t_start) for ts in times]
    m_base, m_start, m_end = raw["metrics"]
    d = lambda a, b, key: b.get(key, 0.0) - a.get(key, 0.0)  # noqa: E731
    prefills = raw["prefills"]
    ok = [rec for _, _, rec in prefills if not rec.error]
    problems = []
    errors = sorted({rec.error for _, _, rec in prefills if rec.error})
    if errors:
        problems.append(f"{len(prefills) - len(ok)} long prompts failed: {errors[0]}")
    early = sum(1 for rec in decodes if rec.finished_at is not None and rec.finished_at < t_end)
    if early:
        problems.append(f"{early} decodes finished before the long prompts did (raise --decode-output-len, or the "
                        "server's --max-model-len)")
    if any(n == 0 for n in chunks_in):
        problems.append("a decode streamed nothing during the interference window")
    if not base_gaps:
        problems.append("no baseline ITL samples (raise --baseline-s)")
    preempt = d(m_base, m_end, "mtpspec:num_preemptions_total")
    if preempt:
        problems.append(f"the server preempted {preempt:.0f} times (its KV cache is too small for this workload)")
    hits = d(m_start, m_end, "mtpspec:prefix_cache_hits_total")
    if hits:
        problems.append(f"the prefix cache served {hits:.0f} tokens of the long prompts")
    failed = sorted({rec.error for rec in decodes if rec.error})
    if failed:
        problems.append(f"{sum(1 for rec in decodes if rec.error)} decodes failed while running: {failed[0]}")
    lag = {name: itl_stats([x for t, x in raw["lags"] if w0 <= t <= w1])
           for name, (w0, w1) in (("baseline", (t_base, t_start)), ("interference", (t_start, t_end)))}
    for name, st in (("baseline", base), ("interference", inter)):
        if lag[name]["p99"] is not None and st["median"] and lag[name]["p99"] > CLIENT_LAG_LIMIT * st["median"]:
            problems.append(f"client event-loop lag p99 {lag[name]['p99']:.2f} ms in the {name} window is over "
                            f"{CLIENT_LAG_LIMIT:.0%} of the ITL median: the client may distort the figures (raise "
                            "--client-procs, or free CPU cores)")
    if not raw["drained"]:
        problems.append("the server still ran requests 30 s after the decodes were cancelled")
    ttfts = [rec.ttft for rec in ok if rec.ttft is not None]
    base_s, inter_s = t_start - t_base, t_end - t_start
    reasons = ["random-token prompts", "ignore_eos"]
    if info.forced_acceptance:
        reasons.append(f"forced acceptance {info.forced_acceptance}")
    rel = lambda t: None if t is None else t - t0  # noqa: E731
    return {
        "synthetic": True, "synthetic_reasons": reasons,
        "server": {"base_url": base_url, "model": info.model, "max_model_len": info.max_model_len, **info.info},
        "config": {**asdict(cfg), "decode_output_len": decode_len},
        "max_num_batched_tokens": derived_batched_tokens(info.info, info.max_model_len) if info.info else None,
        "phases_s": {"ready": raw["t_ready"] - t0, "warmup": t_base - raw["t_ready"], "baseline": base_s,
                     "interference": inter_s},
        "itl_ms": {"baseline": base, "interference": inter},
        "itl_p99_over_median": verdict["ratio"],
        "itl_p99_over_baseline_median": (inter["p99"] / base["median"]) if base["median"] and inter["p99"] else None,
        "goal": {"rule": f"interference-window ITL p99 <= {GOAL_RATIO:g} x its median", **verdict},
        "decode_chunks_in_window": {"min": min(chunks_in), "median": statistics.median(chunks_in)},
        "decode_tokens_per_s": {"baseline": tokens_in([x.chunks for x in decodes], t_base, t_start) / base_s,
                                "interference": tokens_in([x.chunks for x in decodes], t_start, t_end) / inter_s},
        "engine_steps": {"baseline": d(m_base, m_start, "mtpspec:engine_steps_total"),
                         "interference": d(m_start, m_end, "mtpspec:engine_steps_total")},
        "preemptions": preempt, "prefix_cache_hits_in_window": hits,
        "client_loop_lag_ms": {k: {"p99": v["p99"], "max": v["max"]} for k, v in lag.items()},
        "prefill": {"completed": len(ok), "failed": len(prefills) - len(ok),
                    "ttft_ms": {"median": _pct([t * 1000 for t in ttfts], 50), "max": max(ttfts) * 1000 if ttfts
                                else None, "mean": statistics.fmean(ttfts) * 1000 if ttfts else None},
                    "prompt_tokens": sorted({rec.prompt_tokens for rec in ok}),
                    "requests": [{"client": c, "index": j, "sent_s": rel(rec.sent), "first_token_s": rel(
                        rec.chunks[0][0] if rec.chunks else None), "done_s": rel(rec.done_at),
                        "ttft_ms": None if rec.ttft is None else rec.ttft * 1000, "prompt_tokens": rec.prompt_tokens,
                        "error": rec.error} for c, j, rec in prefills],
                    "warmup_ttft_ms": [rec.ttft * 1000 for rec in raw["warm"] if rec.ttft is not None]},
        "windows_s": {"baseline": [rel(t_base), rel(t_start)], "interference": [rel(t_start), rel(t_end)]},
        "problems": problems,
    }


# ---------------------------------------------------------------------------- report
def format_interference_result(res: Dict[str, Any]) -> str:
    """A compact table of one run, ending with the goal's verdict."""
    f = lambda x, spec=".2f": "-" if x is None else format(x, spec)  # noqa: E731
    s, c = res["server"], res["config"]
    title = "mtpspec bench serve --prefill-interference   [SYNTHETIC: " + ", ".join(res["synthetic_reasons"]) + "]"
    ph = res["phases_s"]
    lines = ["=" * 78, title, "=" * 78,
             f"server                      {s.get('model')}  (k={s.get('num_speculative_tokens')} tp={s.get('tp')} "
             f"max_num_seqs={s.get('max_num_seqs')})",
             f"chunked prefill             {s.get('enable_chunked_prefill')}  (max_num_batched_tokens="
             f"{res.get('max_num_batched_tokens')}, long_prefill_token_threshold="
             f"{s.get('long_prefill_token_threshold')})",
             f"workload                    {c['num_decodes']} running decodes (in {c['decode_input_len']}, max_tokens "
             f"{c['decode_output_len']}, ignore_eos); {c['num_prefill_clients']} clients x {c['prefill_requests']} "
             f"prompts of {c['prefill_input_len']} tokens (out {c['prefill_output_len']})",
             f"phases                      ready {ph['ready']:.2f} s, warm-up {ph['warmup']:.2f} s, baseline "
             f"{ph['baseline']:.2f} s, interference {ph['interference']:.2f} s",
             f"decode ITL per chunk (ms)   {'count':>7} {'median':>9} {'p90':>9} {'p99':>9} {'max':>9}"]
    for name in ("baseline", "interference"):
        st = res["itl_ms"][name]
        lines.append(f"  {name:<25} {st['count']:>7} {f(st['median']):>9} {f(st['p90']):>9} {f(st['p99']):>9} "
                     f"{f(st['max']):>9}")
    tps, steps = res["decode_tokens_per_s"], res["engine_steps"]
    pf = res["prefill"]
    lines += [
        f"ITL p99 / median            {f(res['itl_p99_over_median'], '.3f')} (interference window); "
        f"p99 / baseline median {f(res['itl_p99_over_baseline_median'], '.3f')}",
        f"decode tokens/s             baseline {tps['baseline']:.1f}, interference {tps['interference']:.1f}",
        f"engine steps                baseline {steps['baseline']:.0f}, interference {steps['interference']:.0f}  "
        f"(decode chunks in the window: min {res['decode_chunks_in_window']['min']})",
        f"long-prompt TTFT (ms)       median {f(pf['ttft_ms']['median'])}, max {f(pf['ttft_ms']['max'])}  "
        f"({pf['completed']} ok / {pf['failed']} failed)",
        f"client loop lag p99 (ms)    baseline {f(res['client_loop_lag_ms']['baseline']['p99'])}, interference "
        f"{f(res['client_loop_lag_ms']['interference']['p99'])}  ({c['client_procs']} client processes)",
    ]
    for p in res["problems"]:
        lines.append(f"WARNING: {p}")
    g = res["goal"]
    if g["met"] is None:
        verdict = "NOT MEASURED (no ITL samples in the window)"
    else:
        verdict = ("MET" if g["met"] else "NOT MET") + f": p99 / median = {g['ratio']:.3f} " + \
            ("<=" if g["met"] else ">") + f" {g['limit']:g}"
        if res["problems"]:
            verdict += " (this run has problems, see the warnings)"
    lines += [f"GOAL (issue 17)             {g['rule']}: {verdict}", "=" * 78]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--prefill-interference`` workload's options (``None`` = its default)."""
    g = p.add_argument_group("--prefill-interference workload (issue 17: ITL of running decodes while long prompts "
                             "are prefilled)")
    g.add_argument("--prefill-interference", action="store_true",
                   help="run this workload instead: --num-decodes streaming decodes, then --num-prefill-clients "
                        "clients sending --prefill-input-len-token prompts; ITL of the decodes before and during "
                        "(SYNTHETIC: random prompts, ignore_eos)")
    g.add_argument("--num-decodes", type=int, default=None, help="running decodes (default 60)")
    g.add_argument("--decode-input-len", type=int, default=None, help="prompt tokens per decode (default 32)")
    g.add_argument("--decode-output-len", type=int, default=None,
                   help="max_tokens per decode (default: the server's max_model_len - --decode-input-len; they are "
                        "cancelled when the run ends)")
    g.add_argument("--num-prefill-clients", type=int, default=None, help="clients sending long prompts (default 4)")
    g.add_argument("--prefill-requests", type=int, default=None,
                   help="long prompts per client, one after the other (default 2)")
    g.add_argument("--prefill-input-len", type=int, default=None, help="tokens per long prompt (default 8192)")
    g.add_argument("--prefill-output-len", type=int, default=None, help="max_tokens per long prompt (default 4)")
    g.add_argument("--baseline-s", type=float, default=None, help="seconds of decoding alone before (default 3)")
    g.add_argument("--client-procs", type=int, default=None,
                   help="client processes reading the decode streams (default: one per 15 decodes)")


INTERFERENCE_FLAGS = ("num_decodes", "decode_input_len", "decode_output_len", "num_prefill_clients",
                      "prefill_requests", "prefill_input_len", "prefill_output_len", "baseline_s", "client_procs")


def config_from_args(args: argparse.Namespace) -> InterferenceConfig:
    """The workload from ``bench serve`` options (``--warmup``, ``--temperature``, ``--seed`` shared)."""
    kw = {name: getattr(args, name) for name in INTERFERENCE_FLAGS if getattr(args, name) is not None}
    return InterferenceConfig(warmup=1 if args.warmup is None else args.warmup, temperature=args.temperature,
                              seed=args.seed, **kw)


def misplaced_flags(args: argparse.Namespace) -> List[str]:
    """This workload's flags given without ``--prefill-interference`` (as ``--flag-name``)."""
    if getattr(args, "prefill_interference", False):
        return []
    return ["--" + n.replace("_", "-") for n in INTERFERENCE_FLAGS if getattr(args, n, None) is not None]

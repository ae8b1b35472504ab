"""Prometheus metrics of ``mtpspec serve`` (``GET /metrics``), named after vLLM's with ``mtpspec:``.

Counters come from the engine's own totals (:class:`~mtpspec.spec_decode.metrics.EngineMetrics`),
read after every step in the engine thread and added as deltas; latencies come from each
finished request's :class:`~mtpspec.outputs.RequestMetrics` (TTFT and inter-token latency also
from each aborted one's: the tokens it got). The engine's per-request sample
lists (``ttft_s``, ``itl_s``, ``tpot_s``) are drained into the histograms after each step so they
do not grow for the server's lifetime.

=========================================================  ===========================================
metric                                                     meaning
=========================================================  ===========================================
``mtpspec:num_requests_running`` / ``_waiting`` (gauge)     scheduler queues at scrape time
``mtpspec:kv_cache_free_blocks`` / ``_total_blocks``        KV blocks (per layer cache)
``mtpspec:kv_cache_usage_perc`` (gauge)                     KV blocks in use, a fraction (0 .. 1; vLLM's)
``mtpspec:request_success_total{finished_reason}``          finished requests (stop / length)
``mtpspec:request_aborted_total``                           aborted (client gone) requests
``mtpspec:request_failed_total``                            requests failed inside the engine loop
``mtpspec:prompt_tokens_total``                             each sequence's prompt, at its first token
                                                            (prefix-cache hits included; n > 1: n times;
                                                            vLLM v1's)
``mtpspec:prefill_tokens_total``                            prompt tokens computed (prefilled; recomputes
                                                            included, prefix-cache hits not)
``mtpspec:prefix_cache_queries_total``                      prompt tokens looked up in the prefix cache
``mtpspec:prefix_cache_hits_total``                         of those, tokens the prefix cache served
``mtpspec:generation_tokens_total``                         emitted tokens
``mtpspec:engine_steps_total``                              engine steps
``mtpspec:time_to_first_token_seconds`` (histogram)         TTFT per request (aborted ones too)
``mtpspec:inter_token_latency_seconds`` (histogram)         gap between a request's emitting steps
``mtpspec:request_time_per_output_token_seconds`` (hist.)   per-request mean after the first token
                                                            (vLLM's name for it)
``mtpspec:e2e_request_latency_seconds`` (histogram)         arrival to finish
``mtpspec:request_queue_time_seconds`` (histogram)          arrival to first scheduled
``mtpspec:request_prefill_time_seconds`` (histogram)        first scheduled to first token
``mtpspec:spec_decode_num_drafts_total``                    verifications (one per sequence-step)
``mtpspec:spec_decode_num_draft_tokens_total``              draft tokens checked
``mtpspec:spec_decode_num_accepted_tokens_total``           draft tokens accepted and emitted
``mtpspec:spec_decode_num_accepted_tokens_per_pos_total``   ``{position}``: accepted at draft position
``mtpspec:spec_decode_num_draft_tokens_per_pos_total``      ``{position}``: verified at draft position
``mtpspec:spec_decode_num_speculative_tokens_total``        ``{k}``: engine steps that proposed ``k``
                                                            drafts per sequence (the histogram of the
                                                            k that adaptive speculation chose)
``mtpspec:collective_bytes_total{op}``                      bytes rank 0's collectives sent
``mtpspec:eager_fallbacks_total``                           CUDA-graph fall-backs
``mtpspec:num_preemptions_total``                           recompute preemptions (vLLM's name)
``mtpspec:forced_acceptance``                               1 when SYNTHETIC forced acceptance is on
``mtpspec:engine_info`` (info)                              model, tp, k, fusion, local argmax, ...
=========================================================  ===========================================

Every sample but ``mtpspec:engine_info``'s carries vLLM's ``model_name`` label (the first served model name).
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics, generate_latest

from mtpspec.engine.async_llm import EngineObserver, EngineStats
from mtpspec.outputs import RequestOutput

disable_created_metrics()  # no "*_created" timestamp samples: they only add noise to scrapes

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class _Named:
    """A labelled metric whose samples all carry ``model_name`` (``labels(**kw)`` adds it)."""

    def __init__(self, metric: Any, model_name: str):
        self._metric, self._model_name = metric, model_name

    def labels(self, **kw: str) -> Any:
        return self._metric.labels(model_name=self._model_name, **kw)


class ServerMetrics(EngineObserver):
    """Owns a private registry; :meth:`render` gives the Prometheus text exposition.

    Args:
        num_speculative_tokens: ``k`` (per-position counters ``0 .. k-1``).
        info: string labels for ``mtpspec:engine_info``.
        forced_acceptance: whether forced (synthetic) acceptance is on.
        model_name: the ``model_name`` label of every sample (vLLM's; the first served model name;
            default ``info["model"]``), so dashboards built for vLLM can filter on it.
    """

    def __init__(self, num_speculative_tokens: int, info: Dict[str, str], forced_acceptance: bool = False,
                 model_name: Optional[str] = None):
        r = self.registry = CollectorRegistry()
        self.k = num_speculative_tokens
        self._lock = threading.Lock()
        p = "mtpspec:"
        name = str(model_name if model_name is not None else info.get("model", ""))

        def named(cls: Any, metric: str, doc: str, labels: Sequence[str] = (), **kw: Any) -> Any:
            m = cls(p + metric, doc, ["model_name", *labels], registry=r, **kw)
            return _Named(m, name) if labels else m.labels(model_name=name)
        lat = dict(buckets=_LATENCY_BUCKETS)
        self.running = named(Gauge, "num_requests_running", "Requests in the running batch")
        self.waiting = named(Gauge, "num_requests_waiting", "Requests waiting to be scheduled")
        self.free_blocks = named(Gauge, "kv_cache_free_blocks", "Free KV-cache blocks")
        self.total_blocks = named(Gauge, "kv_cache_total_blocks", "KV-cache blocks in total")
        self.usage = named(Gauge, "kv_cache_usage_perc", "KV-cache usage: blocks in use / blocks (0 .. 1)")
        self.success = named(Counter, "request_success", "Finished requests", ["finished_reason"])
        self.aborted = named(Counter, "request_aborted", "Aborted requests (client disconnected)")
        self.failed = named(Counter, "request_failed", "Requests failed inside the engine loop")
        self.prompt_tokens = named(Counter, "prompt_tokens", "Prompt tokens of sequences that emitted their first "
                                   "token (prefix-cache hits included)")
        self.prefill_tokens = named(Counter, "prefill_tokens", "Prompt tokens computed (recomputes included)")
        self.cache_queries = named(Counter, "prefix_cache_queries",
                                   "Prompt tokens of new requests looked up in the prefix cache")
        self.cache_hits = named(Counter, "prefix_cache_hits", "Prompt tokens served by the prefix cache")
        self.gen_tokens = named(Counter, "generation_tokens", "Emitted tokens")
        self.steps = named(Counter, "engine_steps", "Engine steps")
        self.ttft = named(Histogram, "time_to_first_token_seconds", "Time to first token", **lat)
        self.itl = named(Histogram, "inter_token_latency_seconds", "Gap between emitting steps of a request", **lat)
        self.tpot = named(Histogram, "request_time_per_output_token_seconds",
                          "Per request: mean time per output token after the first", **lat)
        self.e2e = named(Histogram, "e2e_request_latency_seconds", "Arrival to finish", **lat)
        self.queue_time = named(Histogram, "request_queue_time_seconds", "Arrival to first scheduled", **lat)
        self.prefill_time = named(Histogram, "request_prefill_time_seconds", "First scheduled to first token", **lat)
        self.drafts = named(Counter, "spec_decode_num_drafts", "Verifications of k drafts")
        self.draft_tokens = named(Counter, "spec_decode_num_draft_tokens", "Draft tokens checked")
        self.accepted = named(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_pos = named(Counter, "spec_decode_num_accepted_tokens_per_pos", "Accepted at draft position",
                                  ["position"])
        self.draft_pos = named(Counter, "spec_decode_num_draft_tokens_per_pos", "Verified at draft position",
                               ["position"])
        self.chosen_k = named(Counter, "spec_decode_num_speculative_tokens", "Engine steps that proposed k drafts",
                              ["k"])
        self.catch_up = named(Counter, "spec_decode_num_mtp_catch_up_tokens",
                              "MTP KV entries deferred by k = 0 steps and written by a later drafting step")
        self.comm = named(Counter, "collective_bytes", "Bytes sent by rank 0's collectives", ["op"])
        self.fallbacks = named(Counter, "eager_fallbacks", "Steps that could not use a CUDA graph")
        self.preemptions = named(Counter, "num_preemptions", "Recompute preemptions")
        g = named(Gauge, "forced_acceptance", "1: SYNTHETIC forced acceptance is on")
        g.set(1 if forced_acceptance else 0)
        Info(p + "engine", "Engine configuration", registry=r).info({k: str(v) for k, v in info.items()})
        for j in range(self.k):
            self.accepted_pos.labels(position=str(j))
            self.draft_pos.labels(position=str(j))
        for j in range(self.k + 1 if self.k else 0):
            self.chosen_k.labels(k=str(j))
        self._last: Dict[str, Any] = {}

    # ---------------------------------------------------------------- engine thread
    def on_step(self, engine: Any, finished: List[RequestOutput]) -> None:
        m = engine.metrics
        self._add(self.steps, "steps", m.num_steps)
        self._add(self.prompt_tokens, "prompt", m.num_request_prompt_tokens)
        self._add(self.prefill_tokens, "prefill", m.num_prompt_tokens)
        self._add(self.cache_queries, "cache_queries", m.prefix_cache_queries)
        self._add(self.cache_hits, "cache_hits", m.prefix_cache_hits)
        self._add(self.gen_tokens, "gen", m.num_output_tokens)
        self._add(self.fallbacks, "fallbacks", m.num_eager_fallbacks)
        self._add(self.preemptions, "preempt", m.num_preemptions)
        for op, n in m.comm_bytes.items():
            self._add(self.comm.labels(op=op), "comm:" + op, n)
        s = m.spec
        if s is not None:
            self._add(self.drafts, "drafts", s.num_drafts)
            self._add(self.draft_tokens, "draft_tokens", s.num_draft_tokens)
            self._add(self.accepted, "accepted", s.num_accepted_tokens)
            for j, n in enumerate(s.num_accepted_tokens_per_pos):
                self._add(self.accepted_pos.labels(position=str(j)), f"pos:{j}", n)
            for j, n in enumerate(s.num_draft_tokens_per_pos):
                self._add(self.draft_pos.labels(position=str(j)), f"dpos:{j}", n)
            for j, n in enumerate(s.num_speculative_tokens_histogram):
                self._add(self.chosen_k.labels(k=str(j)), f"k:{j}", n)
            self._add(self.catch_up, "catch_up", s.num_mtp_catch_up_tokens)
        # Bound the engine's sample lists; the histograms below take the samples instead.
        m.ttft_s.clear()
        m.itl_s.clear()
        m.tpot_s.clear()
        for out in finished:
            rm = out.metrics
            self.success.labels(finished_reason=out.outputs[0].finish_reason or "unknown").inc()
            self._observe_tokens(rm)
            if rm.tpot is not None:
                self.tpot.observe(rm.tpot)
            if rm.finished_time is not None:
                self.e2e.observe(rm.finished_time - rm.arrival_time)
            if rm.first_scheduled_time is not None:
                self.queue_time.observe(rm.first_scheduled_time - rm.arrival_time)
                if rm.first_token_time is not None:
                    self.prefill_time.observe(rm.first_token_time - rm.first_scheduled_time)

    def on_abort(self, request_id: str, output: Optional[RequestOutput] = None) -> None:
        """Counts the abort; the TTFT and inter-token gaps of the tokens an aborted request got go
        into their histograms too (vLLM v1 records both per step, whether the request finishes or
        not), so a stream the client cut still counts its first token."""
        self.aborted.inc()
        if output is not None and output.metrics is not None:
            self._observe_tokens(output.metrics)

    def _observe_tokens(self, rm: Any) -> None:
        """A request's TTFT and inter-token gaps (s) into their histograms."""
        if rm.ttft is not None:
            self.ttft.observe(rm.ttft)
        for gap in rm.itl:
            self.itl.observe(gap)

    def on_error(self, request_id: str) -> None:
        self.failed.inc()

    def _add(self, counter: Any, key: str, total: float) -> None:
        last = self._last.get(key, 0)
        if total < last:  # the engine's totals were reset
            last = 0
        if total > last:
            counter.inc(total - last)
        self._last[key] = total

    # ---------------------------------------------------------------- scrape
    def render(self, stats: EngineStats) -> bytes:
        """Prometheus text exposition (gauges set from ``stats`` first)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.free_blocks.set(stats.num_free_blocks)
        total = stats.num_total_blocks
        self.usage.set((total - stats.num_free_blocks) / total if total else 0.0)
        self.total_blocks.set(stats.num_total_blocks)
        return generate_latest(self.registry)

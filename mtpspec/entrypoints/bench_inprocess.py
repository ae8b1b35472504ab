"""`bench arms --in-process`: each arm an ``LLM`` in this process, each run one ``LLM.generate`` call.

Why (issue 18's adaptive-speculation goal, BENCHMARKS.md 2026-12-04 session 14): over HTTP the
same arm and workload ran 519 engine steps in one round and about 2,000 in the next at
concurrency 256 (requests trickle in from the client, and the batch then either decodes in
lockstep or staggers), so throughput spread 20-47% between rounds, far more than the 2% the goal
compares. Here every request of a run is queued before the engine's first step, and the
concurrency is the scheduler's running-sequence cap (``max_num_seqs``, set per workload), so under
forced acceptance (re-armed with its seed before each run) a fixed-k arm's run repeats the same
step sequence: what is left between rounds is the device's and the host's timing (the adaptive
arm's choices also follow the step times it measures, so its rounds can differ by a few steps).

A run's result has the fields of :func:`~mtpspec.entrypoints.bench_serve.run_benchmark` that
``bench arms`` reads (throughput, TTFT from the requests' own timestamps, ITL as each request's
mean time per output token after the first (its TPOT: no stream to time chunk by chunk), acceptance and
its per-position rates, the chosen-k histogram, engine steps, collective bytes), from the engine's
counters over the run.

``MTPSPEC_BENCH_PROFILE_DIR=DIR``: each run (its timed part, not its warm-up prompts; ``bench arms
--warmup-rounds`` runs too, numbered first) also runs under ``cProfile`` and writes
``DIR/<tag>_<n>.pstats`` (``<tag>``: ``bench arms``' ``<workload>_<arm>``, else ``k<K>`` with
``_adaptive`` for an adaptive engine; ``n`` counts that tag's runs in this process from 0) and
``DIR/<tag>_<n>.gc.json`` (Python's garbage collections during the run: count and ms per
generation, from ``gc.callbacks``). For where an arm's host time goes; the profiler slows the host
(about 1.5-2x), so those runs' figures are not comparable with unprofiled ones.

``MTPSPEC_ADAPTIVE_TRACE=1``: an adaptive arm's result also has ``adaptive_trace``, the policy's
step-time samples and choices over the run, warm-up included (``adaptive_trace_timed_from``: the
first record of the timed part; :attr:`~mtpspec.spec_decode.adaptive.AdaptiveSpecPolicy.trace`).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

from mtpspec.entrypoints.bench_serve import BenchConfig, _ms


def open_arm(kwargs: Dict[str, Any], forced: Optional[str]) -> Any:
    """``LLM(**kwargs)`` (from ``serve.check_serve_args``) with ``forced`` acceptance installed
    when it speculates (``"rate:P"`` / ``"length:N"``; ignored for plain decoding, as ``serve``
    does)."""
    from mtpspec import LLM
    llm = LLM(**kwargs)
    _arm_forced(llm, forced)
    return llm


def _arm_forced(llm: Any, forced: Optional[str]) -> None:
    from mtpspec.spec_decode.forced_acceptance import ForcedAcceptance, enable_forced_acceptance
    if forced and llm.llm_engine.scheduler_config.num_speculative_tokens:
        enable_forced_acceptance(llm, ForcedAcceptance.parse(forced))  # a fresh generator: the same draws each run


class _Profiler:
    """``cProfile`` + garbage-collection timing of one run (``MTPSPEC_BENCH_PROFILE_DIR``)."""

    _runs: Dict[str, int] = {}

    def __init__(self, folder: str, tag: str):
        import cProfile
        n = self._runs[tag] = self._runs.get(tag, -1) + 1
        self.path = os.path.join(folder, f"{tag}_{n}")
        self.gc = {str(g): [0, 0.0] for g in range(3)}  # generation -> [collections, ms]
        self._t = 0.0
        self.prof = cProfile.Profile()
        self.prof.enable()  # (raises where another profiler is active: nothing installed yet)
        gc.callbacks.append(self._on_gc)

    @classmethod
    def start(cls, llm: Any, tag: Optional[str]) -> Optional["_Profiler"]:
        folder = os.environ.get("MTPSPEC_BENCH_PROFILE_DIR")
        if not folder:
            return None
        os.makedirs(folder, exist_ok=True)
        if tag is None:
            eng = llm.llm_engine
            tag = f"k{eng.scheduler_config.num_speculative_tokens}" + ("_adaptive" if eng.spec_policy is not None else "")
        return cls(folder, tag)

    def _on_gc(self, phase: str, info: Dict[str, int]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            g = self.gc[str(info["generation"])]
            g[0] += 1
            g[1] += (time.perf_counter() - self._t) * 1e3

    def stop(self) -> None:
        """Uninstall, then write the dumps (a failed write only warns: the run's own error, if any,
        stays the one raised)."""
        self.prof.disable()
        gc.callbacks.remove(self._on_gc)
        try:
            self.prof.dump_stats(self.path + ".pstats")
            with open(self.path + ".gc.json", "w") as f:
                json.dump({"collections_and_ms_by_generation": self.gc}, f)
        except OSError as exc:
            print(f"warning: MTPSPEC_BENCH_PROFILE_DIR: could not write {self.path}.*: {exc}", file=sys.stderr)


def _generate(llm: Any, prompts: List[Any], cfg: BenchConfig, output_len: int) -> List[Any]:
    from mtpspec import SamplingParams
    sps = [SamplingParams(max_tokens=output_len, temperature=cfg.temperature, ignore_eos=cfg.ignore_eos,
                          seed=cfg.request_seed(i)) for i in range(len(prompts))]
    inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    return llm.generate(inputs, sps, use_tqdm=False)


def run_in_process(llm: Any, cfg: BenchConfig, forced: Optional[str] = None,
                   profile_tag: Optional[str] = None) -> Dict[str, Any]:
    """One workload on ``llm``: warm-up prompts first (``cfg.warmup`` of them, ``cfg.warmup_output_len``
    tokens), then every timed prompt queued at once with at most ``cfg.max_concurrency`` running.
    ``profile_tag``: the run's name in ``MTPSPEC_BENCH_PROFILE_DIR`` (the module docstring).

    Raises:
        ValueError: ``max_concurrency`` above the engine's ``max_num_seqs``, or a workload longer
            than its ``max_model_len``.
    """
    from mtpspec.entrypoints.bench_dataset import build_prompts
    eng = llm.llm_engine
    sched_cfg = eng.scheduler.config
    cap = sched_cfg.max_num_seqs
    if cfg.max_concurrency > cap:
        raise ValueError(f"concurrency {cfg.max_concurrency} exceeds the engine's max_num_seqs {cap}")
    if cfg.input_len is not None and cfg.input_len + cfg.output_len > sched_cfg.max_model_len:
        raise ValueError(f"input_len {cfg.input_len} + output_len {cfg.output_len} exceed max_model_len "
                         f"{sched_cfg.max_model_len}; lower them (or --scale for presets)")
    tok = llm.get_tokenizer()
    prompts = build_prompts(cfg.prompts, cfg.num_prompts + cfg.warmup, cfg.input_len, llm.model_config.vocab_size,
                            (lambda text: tok.encode(text)) if tok is not None else None, cfg.dataset, cfg.seed)
    warm, prompts = prompts[:cfg.warmup], prompts[cfg.warmup:]
    sched_cfg.max_num_seqs = cfg.max_concurrency
    trace = getattr(getattr(eng, "spec_policy", None), "trace", None)  # MTPSPEC_ADAPTIVE_TRACE: this run's records
    if trace is not None:
        trace.clear()
    timed_from = 0
    try:
        if warm:
            _generate(llm, warm, cfg, cfg.warmup_output_len or cfg.output_len)
        llm.reset_prefix_cache()  # a run starts cold
        _arm_forced(llm, forced)
        llm.reset_metrics()
        timed_from = len(trace) if trace is not None else 0
        profiler = _Profiler.start(llm, profile_tag)
        started_at = time.time()
        t0, cpu0 = time.perf_counter(), time.process_time()
        try:
            outs = _generate(llm, prompts, cfg, cfg.output_len)
        finally:
            if profiler is not None:
                profiler.stop()
        duration, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        sched_cfg.max_num_seqs = cap
    m = llm.get_metrics()
    k = eng.scheduler_config.num_speculative_tokens
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafts = m.get("num_drafts", 0) or 0
    acc = (1.0 + m["num_accepted_tokens"] / drafts) if drafts else None
    per_pos, per_pos_n = m.get("num_accepted_tokens_per_pos", []), m.get("num_draft_tokens_per_pos", [])
    steps = m["num_steps"]
    comm = m["comm_bytes_total"]
    reasons = []
    if cfg.prompts == "random":
        reasons.append("random-token prompts")
    if cfg.ignore_eos:
        reasons.append("ignore_eos")
    if forced and k:
        reasons.append(f"forced acceptance {forced}")
    ttft = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    itl = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    return {
        "synthetic": bool(reasons), "synthetic_reasons": reasons, "in_process": True,
        "server": {"num_speculative_tokens": k, "max_num_seqs": cap}, "config": cfg.as_json(),
        "started_at": started_at, "duration_s": duration,
        "host_cpu_s": cpu_s,  # this process's CPU time over the run (all threads)
        "completed": len(outs), "failed": 0, "errors": [],
        "total_input_tokens": sum(len(o.prompt_token_ids or []) for o in outs), "total_output_tokens": out_tokens,
        "mean_output_len": out_tokens / max(len(outs), 1), "request_throughput": len(outs) / duration,
        "output_throughput": out_tokens / duration, "ttft_ms": _ms(ttft), "itl_ms": _ms(itl), "tpot_ms": _ms(itl),
        "steps_per_s": (out_tokens / duration) / (acc if acc else 1.0), "engine_steps_per_s": steps / duration,
        "num_drafts": drafts, "num_draft_tokens": m.get("num_draft_tokens", 0),
        "num_accepted_tokens": m.get("num_accepted_tokens", 0), "acceptance_length": acc,
        "acceptance_rate_per_pos": [(a / n) if n else None for a, n in zip(per_pos, per_pos_n)],
        "num_speculative_tokens_histogram": [float(x) for x in m.get("num_speculative_tokens_histogram", [])]
        if k else [],
        "mtp_catch_up_tokens": int(m.get("num_mtp_catch_up_tokens", 0)),  # deferred MTP entries written later
        "engine_steps": float(steps), "server_generation_tokens": float(out_tokens),
        "collective_bytes_per_step": {op: b / max(steps, 1) for op, b in sorted(comm.items())},
        "collective_bytes_per_step_total": sum(comm.values()) / max(steps, 1),
        "preemptions": float(m["num_preemptions"]), "eager_fallbacks": float(m["num_eager_fallbacks"]),
        "cuda_graph_capture_failed": _capture_failed(eng),  # why decode steps ran eagerly, if capture failed
        "prefix_cache_hit_rate": m.get("prefix_cache_hit_rate"),
        "adaptive_host_model": _host_model(getattr(eng, "spec_policy", None)),
        # where the run's wall time went, per kind of step (EngineMetrics.step_wall_s)
        "step_wall": {kind: _step_kind(*rec) for kind, rec in m.get("step_wall_s", {}).items()},
        # MTPSPEC_ADAPTIVE_TRACE: the policy's samples and choices over the run, its warm-up's first
        # (AdaptiveSpecPolicy.trace; records from adaptive_trace_timed_from on are the timed run's)
        **({"adaptive_trace": list(trace), "adaptive_trace_timed_from": timed_from} if trace is not None else {}),
    }


def _capture_failed(eng: Any) -> Optional[str]:
    """The engine's CUDA-graph capture failure (:attr:`GraphedForward.capture_failed`), ``None``
    when capture succeeded, the engine runs eagerly by choice, or its runner is in other processes."""
    fwd = getattr(getattr(getattr(eng, "executor", None), "runner", None), "fwd", None)
    return getattr(fwd, "capture_failed", None)


def _step_kind(steps: float, seconds: float, seqs: float = 0, prompt_tokens: float = 0, verified: float = 0,
               catch_up: float = 0) -> Dict[str, Any]:
    """One kind of step of :attr:`~mtpspec.spec_decode.metrics.EngineMetrics.step_wall_s`: its
    steps, wall seconds and mean ms, and per step its mean batch, prompt tokens and verified drafts
    per decode, plus the deferred MTP entries it caught up in all."""
    n = max(int(steps), 1)
    return {"steps": int(steps), "total_s": seconds, "mean_ms": 1e3 * seconds / n, "mean_batch": seqs / n,
            "mean_prompt_tokens": prompt_tokens / n, "mean_verify_k": verified / n, "catch_up_rows": int(catch_up)}


def _host_model(policy: Any) -> Optional[Dict[str, Any]]:
    """The adaptive policy's fitted host time (ms: per step, per sequence, per accepted draft emitted,
    per prompt token of k = 0 and of drafting steps), what it measured beyond the device table per (table batch size, k)
    with the batch size of the median step, what it charges for catching up one deferred MTP entry (us), its
    device table (``cost_table``: ``verify_ms`` / ``draft_ms`` per k and batch size), its per-position
    acceptance rates (``rates``) at the run's end and the re-checks it did (``rechecks``: measures emptied
    because their k or prompt kind was displaced by its own steps)."""
    if policy is None:
        return None
    out: Dict[str, Any] = {name: getattr(policy, attr, None) for name, attr in (
        ("per_step_ms", "overhead_ms"), ("per_seq_ms", "overhead_ms_per_seq"),
        ("per_token_ms", "overhead_ms_per_token"), ("per_prompt_token_ms", "prefill_ms_per_token"),
        ("per_prompt_token_ms_drafting", "draft_prefill_ms_per_token"))}
    out["measured_ms"] = {f"batch {b} k {k}": v for (b, k), v in sorted(getattr(policy, "excess_ms", {}).items())}
    # the mean batch size of the steps behind each (a step of another size is charged along per_seq_ms)
    out["measured_batch"] = {f"batch {b} k {k}": v for (b, k), v in sorted(getattr(policy, "excess_batch", {}).items())}
    # switching k: steps outside a steady run of their k, and their mean ms beyond that k's steady steps
    out["transition_steps"] = getattr(policy, "transition_steps", None)
    out["transition_extra_ms"] = getattr(policy, "transition_extra_ms", None)
    # measures emptied because their k (or prompt kind) was displaced by its own steps (RECHECK_AFTER)
    out["rechecks"] = getattr(policy, "rechecks_done", None)
    rate = getattr(policy, "catch_up_ms_per_row", None)  # what a deferred MTP entry's catch-up costs, as learnt
    out["catch_up_us_per_row"] = 1e3 * rate() if callable(rate) else None
    out["catch_up_rows_timed"] = getattr(policy, "catch_up_rows_timed", None)  # below 256: the table's figure
    # what the choices rest on besides the host figures: the device table (ms per k and batch size) and the
    # per-position acceptance rates at the run's end (session 28: the rates a sweep's choices followed could not
    # be recomputed without them)
    costs = getattr(policy, "costs", None)
    out["cost_table"] = None if costs is None else {"verify_ms": costs.verify_ms, "draft_ms": costs.draft_ms}
    rates = getattr(policy, "rates", None)
    out["rates"] = rates() if callable(rates) else None
    return out


__all__ = ["open_arm", "run_in_process"]

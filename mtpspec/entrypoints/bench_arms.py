"""`mtpspec bench arms`: A/B/C of engine arms, one server per arm, runs interleaved (a Williams order per round)

Arms (``--arms``, default all three; ``--arm NAME=FLAGS`` adds or redefines one):

==============  =======================================  ===================================
arm             `mtpspec serve` flags                    what it is
==============  =======================================  ===================================
``baseline``    ``--no-fusion --no-local-argmax``        unfused MTP tail, full-logits argmax
``fusion``      ``--no-local-argmax``                    + fused all-reduce + RMSNorm
``both``        (none)                                   + vocab-parallel local argmax
``plain``       ``-k 0``                                 plain decoding (not in the default)
``k1``          ``-k 1``                                 fixed speculation length 1
``k2``          ``-k 2``                                 fixed speculation length 2
``k3``          ``-k 3``                                 fixed speculation length 3
``adaptive``    ``-k 3 --adaptive-speculation``          each step's k in 0..3 chosen by the policy
==============  =======================================  ===================================

``adaptive_r50`` is ``adaptive`` with ``--speculative-config '{"adaptive_prompt_reserve": 0.5}'``:
half the token budget kept for waiting prompts (docs/serving.md). ``adaptive_eagerkv`` is ``adaptive``
with ``'{"adaptive_defer_mtp_kv": false}'``: its ``k = 0`` steps write their MTP KV entries
themselves instead of deferring them (the A/B of the deferral). ``adaptive_nohold`` is ``adaptive`` with
``'{"adaptive_hold_k0_steps": 1, "adaptive_hold_draft_steps": 1}'``: the policy asked every step (the A/B of
held choices).
``adaptive_m0`` is ``adaptive`` with ``'{"adaptive_switch_margin": 0}'``: drafting chosen wherever it rates above
``k = 0`` (the A/B of the switch margin).

Every arm's server is started once (one after another, each on its own free port; with
``--base-url NAME=URL`` an already running server is used instead), then each workload runs
``--repeats`` times per arm, interleaved (each round every arm once, in a carry-over balanced order:
:func:`round_order`), so that drift (thermals, other load) hits every arm alike. Workload presets (``--scale`` shrinks lengths and prompt counts for
small machines; explicit ``--input-len`` etc. override):

* ``batch1``: 8192 tokens in, 1024 out, 8 prompts, concurrency 1;
* ``c64``: 1024 in, 1024 out, 256 prompts, concurrency 64;
* ``s1``, ``s8``, ``s64``, ``s256``: 512 in, 256 out, concurrency 1 / 8 / 64 / 256 (4 / 16 / 128 /
  512 prompts): the speculation-length sweep (``--arms plain,k1,k2,k3,adaptive``; the server needs
  ``--max-num-seqs 256`` for ``s256``).

A workload is a concurrency level; ``--request-rate R`` (vLLM's open-loop arrivals, ``bench serve``'s flag)
paces every workload's timed runs at R, with the same seeded arrival times for every arm, the workload's
concurrency still the limit (both apply, as in vLLM); refused with ``--in-process``.

Reported per workload and arm: every run's figures (:mod:`mtpspec.entrypoints.bench_serve`),
their median and spread (max - min over runs), collective bytes per engine step, and a verdict
per pair of arms and figure: a difference counts only when the medians differ by more than the
larger of the two spreads; with an ``adaptive`` arm, its median output tok/s over the best other
arm's, and the same per round (:func:`versus_best`); the host's speed before and after every run
(:func:`host_probe_ms`, a fixed Python loop) and its spread over the workload, with a warning when it
moved by more than ``HOST_SPREAD_WARN`` (differences of host-bound arms below that cannot be read), and
warnings when one arm alone was preempted (:func:`preemption_warning`) or ran decode steps eagerly
instead of through CUDA graphs (:func:`eager_warning`).
``--warmup-rounds N``: N untimed runs of each
workload per arm before the timed ones. ``--in-process``: each arm an ``LLM`` in this process, each run
one ``LLM.generate`` with every request queued before the first step
(:mod:`~mtpspec.entrypoints.bench_inprocess`); with ``--equal-kv-blocks`` (and tp 1: spawned ranks load
in their own processes) the arms hold the model's weights once
(:func:`mtpspec.models.loader.sharing_weights`; each arm's own memory is its KV cache, graphs and
activations; recorded as ``shared_weights``). Output: tables on stdout, ``bench_arms.json`` (every figure; while the
runs go on, ``bench_arms.partial.json`` holds the runs made so far and their settings, for a sweep
that is killed or fails; a finished sweep removes it) and PNG
plots (each arm's runs of output tok/s and steps/s with median and spread; acceptance rate per
draft position) in ``--output-dir``, made after the JSON is written and the tables printed (a failed plot
only warns). The plots need matplotlib (``pip install 'mtpspec[bench]'``): without it the sweep stops
before any server starts unless ``--no-plots`` is given. Synthetic runs (random prompts, ``--ignore-eos``,
``--forced-acceptance``) are marked SYNTHETIC in every table, plot title and the JSON.

``--server-args`` is one value, every arm's extra `mtpspec serve` flags: ``--server-args '-tp 2
--enforce-eager'``, ``--server-args --enforce-eager`` (the word after ``--server-args`` is always its
value, even when it starts with ``--``) or ``--server-args=...``. It is split as a shell splits words
(:func:`split_flags`; so are ``--arm`` flags), except that a JSON object or array is kept as written:
``--server-args '--speculative-config {"num_speculative_tokens": 3}'`` works, as does the JSON in
single quotes inside the value.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mtpspec.entrypoints.bench_serve import BenchConfig, add_arguments, config_from_args, format_rate, run_benchmark

#: max_tokens of each warm-up request (the default warm-up is two waves at the workload's concurrency).
WARMUP_OUTPUT_LEN = 16
#: What a sweep has run so far, in ``--output-dir`` until it finishes (:func:`run_arms`).
PARTIAL_JSON = "bench_arms.partial.json"

DEFAULT_ARMS: Dict[str, List[str]] = {
    "baseline": ["--no-fusion", "--no-local-argmax"],
    "fusion": ["--no-local-argmax"],
    "both": [],
    # speculation length (not in the default --arms): plain decoding, fixed k, adaptive k
    "plain": ["-k", "0"],
    "k1": ["-k", "1"],
    "k2": ["-k", "2"],
    "k3": ["-k", "3"],
    "adaptive": ["-k", "3", "--adaptive-speculation"],
    # adaptive with half the token budget kept for waiting prompts (docs/serving.md)
    "adaptive_r50": ["-k", "3", "--adaptive-speculation", "--speculative-config",
                     '{"adaptive_prompt_reserve": 0.5, "use_local_argmax_reduction": true}'],
    # adaptive whose k = 0 steps write their MTP KV entries (no deferral): the deferral's A/B
    "adaptive_eagerkv": ["-k", "3", "--adaptive-speculation", "--speculative-config",
                         '{"adaptive_defer_mtp_kv": false, "use_local_argmax_reduction": true}'],
    # adaptive asked every step (no held choices): the holds' A/B
    "adaptive_nohold": ["-k", "3", "--adaptive-speculation", "--speculative-config",
                        '{"adaptive_hold_k0_steps": 1, "adaptive_hold_draft_steps": 1, '
                        '"use_local_argmax_reduction": true}'],
    # adaptive without the switch margin (drafting wherever it rates above k = 0): the margin's A/B
    "adaptive_m0": ["-k", "3", "--adaptive-speculation", "--speculative-config",
                    '{"adaptive_switch_margin": 0, "use_local_argmax_reduction": true}'],
}

PRESETS: Dict[str, Dict[str, int]] = {
    "batch1": dict(input_len=8192, output_len=1024, num_prompts=8, max_concurrency=1),
    "c64": dict(input_len=1024, output_len=1024, num_prompts=256, max_concurrency=64),
    # the speculation-length sweep (issue 18): concurrency 1, 8, 64, 256 at one length
    "s1": dict(input_len=512, output_len=256, num_prompts=4, max_concurrency=1),
    "s8": dict(input_len=512, output_len=256, num_prompts=16, max_concurrency=8),
    "s64": dict(input_len=512, output_len=256, num_prompts=128, max_concurrency=64),
    "s256": dict(input_len=512, output_len=256, num_prompts=512, max_concurrency=256),
}

# figure -> (label, higher is better)
FIGURES: Dict[str, Tuple[str, bool]] = {
    "output_throughput": ("output tok/s", True),
    "steps_per_s": ("steps/s", True),
    "ttft_median_ms": ("TTFT p50 ms", False),
    "itl_median_ms": ("ITL p50 ms", False),
    "acceptance_length": ("acc. length", True),
    "collective_bytes_per_step": ("coll. B/step", False),
}


def workload_config(name: str, args: argparse.Namespace) -> BenchConfig:
    """Workload ``name`` scaled by ``args.scale``, the ``bench serve`` flags applied. Without
    ``--warmup`` the warm-up is two waves at the workload's concurrency (at most its prompts),
    ``WARMUP_OUTPUT_LEN`` tokens each: the first server to run a new batch shape would otherwise
    pay Triton's kernel compilation inside its timed run (seen on the H200: 1.4 s of one arm's TTFT
    at concurrency 8). The second wave's prompts arrive while the first wave's last requests still
    decode, so steps mixing prompt chunks into decodes are compiled too (one wave, starting
    together, left the first server of a sweep 2x slower at s8, 2026-12-03).

    Raises:
        ValueError: as :func:`scaled_preset` and :class:`BenchConfig`.
    """
    preset: Dict[str, Any] = scaled_preset(name, args.scale)
    preset.update(warmup=min(2 * preset["max_concurrency"], preset["num_prompts"]),
                  warmup_output_len=min(WARMUP_OUTPUT_LEN, preset["output_len"]))
    return config_from_args(args, preset)


def scaled_preset(name: str, scale: float) -> Dict[str, int]:
    """A preset with lengths and prompt count multiplied by ``scale`` (concurrency capped by prompts).

    Raises:
        ValueError: unknown preset or ``scale`` not in (0, 1].
    """
    if name not in PRESETS:
        raise ValueError(f"unknown workload {name!r}; expected one of {sorted(PRESETS)}")
    if not 0.0 < scale <= 1.0:
        raise ValueError(f"--scale must be in (0, 1], got {scale}")
    p = PRESETS[name]
    n = max(1, round(p["num_prompts"] * scale))
    return dict(input_len=max(8, round(p["input_len"] * scale)), output_len=max(4, round(p["output_len"] * scale)),
                num_prompts=n, max_concurrency=min(p["max_concurrency"], n))


def parse_arms(names: str, extra: Sequence[str]) -> Dict[str, List[str]]:
    """Arms to run, in order: ``names`` (comma-separated) from the defaults and ``--arm NAME=FLAGS``.

    ``FLAGS`` are split by :func:`split_flags`.

    Raises:
        ValueError: an unknown arm name, an arm named twice, no arm at all (``--arms ,``), a malformed
            ``--arm`` or an unclosed quote in its flags.
    """
    table = dict(DEFAULT_ARMS)
    custom = []
    for spec in extra:
        name, sep, flags = spec.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--arm must look like NAME=FLAGS (e.g. 'nofuse=--no-fusion'), got {spec!r}")
        table[name.strip()] = split_flags(flags)
        custom.append(name.strip())
    wanted = [n.strip() for n in names.split(",") if n.strip()] if names else list(DEFAULT_ARMS)
    for n in custom:
        if n not in wanted:
            wanted.append(n)
    unknown = [n for n in wanted if n not in table]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; known: {sorted(table)} (define one with --arm NAME=FLAGS)")
    if not wanted:  # (the sweep crashed on its first round with a TypeError)
        raise ValueError(f"--arms {names!r} names no arm; expected some of {sorted(table)}, comma-separated")
    twice = sorted({n for n in wanted if wanted.count(n) > 1})
    if twice:  # (ran once, silently: no comparison); an A/A run needs a second name
        raise ValueError(f"--arms names {twice} more than once ({names!r}); name each arm once (for an A/A "
                         f"run give the copy its own name: --arm '{twice[0]}2=...' with the same flags)")
    return {n: table[n] for n in wanted}


def parse_workloads(names: str) -> List[str]:
    """``--workloads`` (comma-separated preset names) as a list, in order.

    Raises:
        ValueError: no workload at all (``--workloads ,``: the sweep loaded every arm, ran nothing and
            exited 0) or one named twice (it ran once, silently); an unknown name is left to
            :func:`scaled_preset`.
    """
    wanted = [w.strip() for w in names.split(",") if w.strip()]
    if not wanted:
        raise ValueError(f"--workloads {names!r} names no workload; expected some of {list(PRESETS)}, "
                         "comma-separated")
    twice = sorted({w for w in wanted if wanted.count(w) > 1})
    if twice:
        raise ValueError(f"--workloads names {twice} more than once ({names!r}); name each workload once "
                         "(--repeats runs each more often)")
    return wanted


_JSON_WORD = re.compile(r"(-{1,2}[A-Za-z0-9][\w.-]*=)?[{\[]")


def _json_end(s: str, i: int) -> Optional[int]:
    """The index just past the bracketed value (``{...}`` / ``[...]``) that starts at ``s[i]``,
    brackets inside JSON strings ignored; ``None`` when it is not closed."""
    depth, in_str, esc = 0, False, False
    for j in range(i, len(s)):
        c = s[j]
        if in_str:
            esc, in_str = (False, in_str) if esc else (c == "\\", c != '"')
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def split_flags(s: str) -> List[str]:
    """``--server-args`` / ``--arm`` flags, one string, as a list: split as a POSIX shell splits words
    (:func:`shlex.split`), except that a word that is a JSON object or array (``{...}``, ``[...]``,
    or ``--flag={...}``) as written, up to whitespace or the end, is kept verbatim, spaces and
    double quotes included (the shell's rules would strip its quotes and split it at its spaces):
    ``'--speculative-config {"num_speculative_tokens": 3}'`` gives ``["--speculative-config",
    '{"num_speculative_tokens": 3}']``, as does ``--speculative-config '{"num_speculative_tokens": 3}'``
    (quoted JSON takes the shell's rules). A bracketed word that is not valid JSON takes the shell's rules.

    Raises:
        ValueError: an unclosed quote (shlex's ``No closing quotation``).
    """
    out: List[str] = []
    i, n = 0, len(s)
    while i < n:
        if s[i].isspace():
            i += 1
            continue
        m = _JSON_WORD.match(s, i)
        if m:
            end = _json_end(s, m.end() - 1)
            if end is not None and (end == n or s[end].isspace()):
                try:
                    json.loads(s[m.end() - 1:end])
                    out.append(s[i:end])
                    i = end
                    continue
                except ValueError:
                    pass
        lex = shlex.shlex(s[i:], posix=True)  # one word by the shell's rules, as shlex.split reads it
        lex.whitespace_split, lex.commenters = True, ""
        word = lex.get_token()
        if word is None:  # only possible at the end (whitespace was skipped above)
            break
        out.append(word)
        i += lex.instream.tell()
    return out


def join_server_args(argv: Sequence[str]) -> List[str]:
    """``argv`` with every ``--server-args VALUE`` made ``--server-args=VALUE``: the word after
    ``--server-args`` is its value even when it starts with ``-`` (argparse would take
    ``--server-args --enforce-eager`` for two options). Words after ``--`` are left alone."""
    out: List[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            out.extend(argv[i:])
            break
        if a == "--server-args" and i + 1 < len(argv):
            out.append(f"--server-args={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


#: ``--server-args`` with JSON in it, as a shell command line (errors about JSON name it).
SERVER_ARGS_JSON_FORM = "--server-args '--speculative-config {\"num_speculative_tokens\": 3}'"
#: How ``--server-args`` is written (its errors name these).
SERVER_ARGS_FORMS = f"--server-args '--enforce-eager -tp 2', --server-args --enforce-eager, or {SERVER_ARGS_JSON_FORM}"


# ---------------------------------------------------------------------------- servers
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ArmServer:
    """`mtpspec serve` for one arm in a subprocess on 127.0.0.1 (its output in ``log_path``)."""

    def __init__(self, name: str, flags: List[str], common: List[str], log_path: str, timeout_s: float = 1800.0):
        import httpx
        self.name = name
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "mtpspec.entrypoints.cli", "serve", "--host", "127.0.0.1",
                    "--port", str(self.port)] + common + flags
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"server for arm {name!r} exited ({self.proc.returncode}); log {log_path}:\n"
                                   + open(log_path).read()[-3000:])
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server for arm {name!r} not healthy after {timeout_s:.0f} s; log {log_path}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()


# ---------------------------------------------------------------------------- statistics
def _median(xs: Sequence[float]) -> Optional[float]:
    s = sorted(x for x in xs if x is not None)
    if not s:
        return None
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])


def run_figures(res: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """The figures compared between arms, from one :func:`run_benchmark` result."""
    return {"output_throughput": res["output_throughput"], "steps_per_s": res["steps_per_s"],
            "ttft_median_ms": res["ttft_ms"]["median"], "itl_median_ms": res["itl_ms"]["median"],
            "acceptance_length": res["acceptance_length"],
            "collective_bytes_per_step": res["collective_bytes_per_step_total"]}


def summarise(runs: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per figure: the runs' values, their median and spread (max - min)."""
    out: Dict[str, Dict[str, Any]] = {}
    for key in FIGURES:
        vals = [run_figures(r)[key] for r in runs]
        real = [v for v in vals if v is not None]
        out[key] = {"runs": vals, "median": _median(real),
                    "spread": (max(real) - min(real)) if real else None}
    k = max((len(r["acceptance_rate_per_pos"]) for r in runs), default=0)
    out["acceptance_rate_per_pos"] = {"median": [_median([r["acceptance_rate_per_pos"][j] for r in runs
                                                          if j < len(r["acceptance_rate_per_pos"])])
                                                 for j in range(k)]}
    return out


def verdict(a: Dict[str, Any], b: Dict[str, Any], higher_is_better: bool, repeats: int) -> Dict[str, Any]:
    """Compare arm B's summary of one figure with arm A's.

    A difference counts only when ``|median_B - median_A|`` exceeds the larger spread.
    Returns ``{"delta", "delta_pct", "spread", "significant", "text"}``.
    """
    ma, mb = a["median"], b["median"]
    if ma is None or mb is None:
        return {"delta": None, "delta_pct": None, "spread": None, "significant": False, "text": "n/a"}
    delta = mb - ma
    spread = max(a["spread"] or 0.0, b["spread"] or 0.0)
    pct = 100.0 * delta / ma if ma else None
    pct_s = f"{pct:+.1f}%" if pct is not None else f"{delta:+.3g}"
    if repeats < 2:
        return {"delta": delta, "delta_pct": pct, "spread": None, "significant": False,
                "text": f"{pct_s} (one run per arm: no spread, no verdict)"}
    sig = abs(delta) > spread
    if not sig:
        text = f"no difference beyond run-to-run spread ({pct_s}, spread {spread:.3g})"
    else:
        better = (delta > 0) == higher_is_better
        size = f"{abs(pct):.1f}%" if pct is not None else f"{abs(delta):.3g}"
        text = (f"{'higher' if delta > 0 else 'lower'} by {size}: {'better' if better else 'worse'} "
                f"(beyond spread {spread:.3g})")
    return {"delta": delta, "delta_pct": pct, "spread": spread, "significant": sig, "text": text}


# ---------------------------------------------------------------------------- report
def _f(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:#.3g}" if abs(x) < 10 else f"{x:.1f}"  # 2.00 beside 3.15


def format_workload(name: str, wl: Dict[str, Any]) -> str:
    """Tables of one workload: per-run figures, medians and spreads, verdicts."""
    synth = "   [SYNTHETIC: " + ", ".join(wl["synthetic_reasons"]) + "]" if wl["synthetic"] else ""
    c = wl["config"]
    lines = ["=" * 96, f"workload {name}: in {c['input_len'] or 'natural'}, out {c['output_len']}, "
             f"{c['num_prompts']} prompts, concurrency {c['max_concurrency']}"
             + ("" if c.get("request_rate", "inf") == "inf" else f", rate {format_rate(c)}")
             + f", {wl['repeats']} runs/arm{synth}",
             "=" * 96]
    w = max([10] + [len(arm) for arm in wl["arms"]])  # the arm column fits the longest name
    head = f"{'arm':<{w}} {'run':>4} " + " ".join(f"{FIGURES[k][0]:>14}" for k in FIGURES)
    lines.append(head)
    for arm, data in wl["arms"].items():
        for i, res in enumerate(data["runs"]):
            fig = run_figures(res)
            lines.append(f"{arm:<{w}} {i + 1:>4} " + " ".join(f"{_f(fig[k]):>14}" for k in FIGURES))
        s = data["summary"]
        lines.append(f"{arm:<{w}} {'med':>4} " + " ".join(f"{_f(s[k]['median']):>14}" for k in FIGURES))
        lines.append(f"{arm:<{w}} {'sprd':>4} " + " ".join(f"{_f(s[k]['spread']):>14}" for k in FIGURES))
        rates = ", ".join("-" if r is None else f"{r:.3f}" for r in s["acceptance_rate_per_pos"]["median"])
        lines.append(f"{'':<{w}} acceptance rate per draft position (median; -: no step drafted there): [{rates}]")
        hists = [r.get("num_speculative_tokens_histogram") or [] for r in data["runs"]]
        if any(any(h[:-1]) for h in hists):  # adaptive speculation length: steps per chosen k, each run
            lines.append(f"{'':<{w}} steps proposing k = 0, 1, ... per run: {[[int(x) for x in h] for h in hists]}")
            caught = [r.get("mtp_catch_up_tokens") for r in data["runs"]]
            if any(c is not None for c in caught):  # in-process runs: deferred MTP entries written later
                lines.append(f"{'':<{w}} deferred MTP entries written later per run: {caught}")
        walls = data["runs"][0].get("step_wall") if data["runs"] else None
        if walls:  # in-process runs: where run 1's wall time went, per kind of step
            parts = ", ".join(f"{kind} {v['steps']} x {v['mean_ms']:.2f} ms" + _kind_detail(v)
                              for kind, v in sorted(walls.items()))
            lines.append(f"{'':<{w}} run 1's steps by kind (steps x mean wall [mean batch, prompt tokens, "
                         f"catch-up rows]): {parts}")
        lines.append("-" * 96)
    for pair, figs in wl["verdicts"].items():
        lines.append(f"{pair}:")
        for key, v in figs.items():
            lines.append(f"    {FIGURES[key][0]:<14} {v['text']}")
    vs = versus_best(wl)
    if vs is not None:
        rounds = ", ".join("-" if r is None else f"{r:.3f}" for r in vs["per_round"])
        paired = "-" if vs["per_round_median"] is None else f"{vs['per_round_median']:.3f}"
        lines.append(f"{vs['arm']} / best other arm ({vs['best']}), output tok/s medians: {vs['ratio']:.3f}; "
                     f"per interleaved round: [{rounds}], their median {paired}")
    for warn in (preemption_warning(wl), eager_warning(wl)):
        if warn:
            lines.append(warn)
    hs = host_spread(wl)
    if hs is not None:
        lines.append(f"host probe (a fixed Python loop before and after each run): {hs['min_ms']:.1f} to "
                     f"{hs['max_ms']:.1f} ms, spread {hs['spread']:.2f}x"
                     + (f"; WARNING: the host's speed moved by more than {HOST_SPREAD_WARN:.2f}x, so differences "
                        "between arms in host-bound runs smaller than that are not readable"
                        if hs["spread"] > HOST_SPREAD_WARN else ""))
    redone = len(next(iter(wl.get("host_perturbed_runs", {}).values()), []))
    if redone:
        lines.append(f"rounds run again for a slow host (--host-retries; their runs in host_perturbed_runs): {redone}")
    return "\n".join(lines)


#: Iterations of the host-speed probe's Python loop (~10 ms on a 2020s server core).
HOST_PROBE_ITERS = 200_000
#: Above this max / min of a workload's host probes, the table warns that arm differences smaller
#: than the spread cannot be read (session 17: an H200 host's cores ran one loop 0.17 to 0.35 s).
HOST_SPREAD_WARN = 1.10


def host_probe_ms(iters: int = HOST_PROBE_ITERS, repeats: int = 3) -> float:
    """The host's speed now: the fastest of ``repeats`` timings (ms) of a fixed pure-Python loop of
    ``iters`` integer steps (the kind of work an engine step's host side does). Comparable between
    the runs of one sweep; on a host whose cores change speed (shared machines, frequency scaling)
    it moves with the host-bound part of every run."""
    best = float("inf")
    for _ in range(repeats):
        t, acc = time.perf_counter(), 0
        for i in range(iters):
            acc += i * i % 7
        best = min(best, (time.perf_counter() - t) * 1e3)
    return best


def host_spread(wl: Dict[str, Any]) -> Optional[Dict[str, float]]:
    """``{"min_ms", "max_ms", "spread"}`` of the host probes taken before and after every run of a
    workload (all arms); ``None`` when no run has them."""
    probes = [p for data in wl["arms"].values() for r in data["runs"] for p in (r.get("host_probe_ms") or [])]
    if not probes:
        return None
    return {"min_ms": min(probes), "max_ms": max(probes), "spread": max(probes) / min(probes)}


def _sizes_kv(flags: Sequence[str]) -> bool:
    """Whether ``flags`` (`mtpspec serve` flags, abbreviations included) size the KV cache
    themselves: its blocks, or a GPU share other than the default."""
    from mtpspec.engine.arg_utils import EngineArgs
    from mtpspec.entrypoints.serve import parse_serve_flags
    args = parse_serve_flags(list(flags))
    return args.num_kv_blocks is not None or args.gpu_memory_utilization != EngineArgs.gpu_memory_utilization


def equal_kv_blocks(workloads: Dict[str, BenchConfig], arm_kwargs: Dict[str, Dict[str, Any]]) -> Dict[str, int]:
    """``--num-kv-blocks`` per arm such that every arm holds the same number of KV tokens, enough
    for every workload's concurrent requests whole (``bench arms --equal-kv-blocks``): with a share
    of the GPU each, a speculative arm (its MTP layer's cache) and an adaptive one (its hidden-state
    cache of deferred entries) hold fewer tokens than plain decoding, and where one arm is
    preempted and the others are not the comparison measures memory, not speed.

    Per arm (its block size ``bs``, ``k`` drafts, ``max_model_len``): a request holds ``input_len``
    (``max_model_len`` for prompts of natural length) ``+ output_len + 2k + 1`` slots (a decode's
    lookahead, ``SchedulerConfig.decode_slots``, and the token scheduled ahead), rounded up to
    blocks, plus one block; the workload needs ``max_concurrency`` of them, and the engine one
    sequence of ``max_model_len + 2k`` slots. The largest of those, in tokens, over arms and
    workloads, plus 10% (the block manager's 1% watermark included), is every arm's capacity.

    Args:
        workloads: name -> :class:`BenchConfig`.
        arm_kwargs: arm -> its ``LLM(...)`` keyword arguments (``serve.check_serve_args`` of the
            common + the arm's flags): ``block_size`` (``None``: the architecture's default),
            ``max_model_len`` (``None``: the model's, at most ``DEFAULT_MAX_MODEL_LEN``),
            ``speculative_config``, ``model``.

    Returns:
        arm -> blocks (empty without arms or workloads).
    """
    from mtpspec.config import ModelConfig
    from mtpspec.engine.arg_utils import DEFAULT_MAX_MODEL_LEN
    shape: Dict[str, Tuple[int, int, int]] = {}
    tokens = 0
    for arm, kw in arm_kwargs.items():
        mcfg = None
        if kw.get("block_size") is None or kw.get("max_model_len") is None:
            mcfg = ModelConfig.from_pretrained(kw["model"])
        bs = kw.get("block_size") or mcfg.arch.default_block_size
        mml = kw.get("max_model_len") or min(mcfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        spec = kw.get("speculative_config")
        k = int(spec.get("num_speculative_tokens", 1)) if spec else 0  # SpeculativeConfig's default: 1
        shape[arm] = (bs, mml, k)
        blocks = -(-(mml + 2 * k) // bs)  # the engine's own minimum: one longest sequence
        for c in workloads.values():
            per_seq = min(c.input_len or mml, mml) + c.output_len + 2 * k + 1
            blocks = max(blocks, c.max_concurrency * (-(-per_seq // bs) + 1))
        tokens = max(tokens, blocks * bs)
    tokens += -(-tokens // 10)
    return {arm: -(-tokens // bs) for arm, (bs, _, _) in shape.items()}


def preemption_warning(wl: Dict[str, Any]) -> Optional[str]:
    """A warning when some arm's runs of a workload were preempted and another arm's were not:
    then the arms differ in KV capacity at this concurrency, not only in speed (recomputed
    prompts, smaller batches); ``None`` otherwise. Runs without a preemption count are skipped."""
    per = {arm: [r["preemptions"] for r in d["runs"] if r.get("preemptions") is not None]
           for arm, d in wl["arms"].items()}
    hit = {arm: max(v) for arm, v in per.items() if v and max(v) > 0}
    if not hit or len(hit) == sum(1 for v in per.values() if v):
        return None
    said = ", ".join(f"{arm} up to {n:.0f}" for arm, n in hit.items())
    return (f"WARNING: preemptions in {said} of the runs, none in the other arms that count them: the arms differ "
            "in KV capacity at this concurrency, not only in speed (--equal-kv-blocks gives every arm the same)")


def eager_warning(wl: Dict[str, Any]) -> Optional[str]:
    """A warning naming the arms whose decode steps ran eagerly instead of through CUDA graphs
    (``eager_fallbacks`` > 0: a batch above the largest graph, or the capture failed, with its
    reason where the run recorded it): their figures measure the eager engine; ``None`` otherwise."""
    bits = []
    for arm, d in wl["arms"].items():
        n = max((r.get("eager_fallbacks") or 0 for r in d["runs"]), default=0)
        if n > 0:
            why = next((r["cuda_graph_capture_failed"] for r in d["runs"] if r.get("cuda_graph_capture_failed")), None)
            bits.append(f"{arm} up to {n:.0f} a run" + (f" ({why})" if why else ""))
    if not bits:
        return None
    return "WARNING: decode steps ran eagerly, not through CUDA graphs, in " + "; ".join(bits) + \
        ": those figures are not the graphed engine's"


def round_order(arms: List[str], i: int) -> List[str]:
    """The order of ``arms`` in interleaved round ``i``: a Williams design (E. J. Williams 1949, "Experimental
    designs balanced for the estimation of residual effects of treatments", Aust. J. Sci. Res. A 2:149-168),
    so that no arm always runs right after the same one. Even ``n`` arms: row ``i mod n`` of the square
    whose first row is ``0, 1, n-1, 2, n-2, ...`` and row ``r`` adds ``r`` (mod ``n``): over ``n`` rounds
    each arm runs once in each position and after each other arm once. Odd ``n``: that square's rows and
    their reversals alternate (round ``2j``: row ``j``, ``2j + 1``: row ``j`` reversed), balanced over
    ``2n`` rounds. (A plain rotation, A B C D, B C D A, ..., ran D after C in every round: session 40's
    adaptive arm always followed k3.) Two arms: A B, B A."""
    n = len(arms)
    if n < 2:
        return list(arms)
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        if len(first) % 2:
            first, lo = first + [lo], lo + 1
        else:
            first, hi = first + [hi], hi - 1
    shift = i % n if n % 2 == 0 else (i // 2) % n
    row = [(x + shift) % n for x in first]
    if n % 2 and i % 2:
        row.reverse()
    return [arms[x] for x in row]


def _kind_detail(v: dict) -> str:
    """`` [B 256, P 418, catch-up 131072]`` of one kind of step (mean batch, mean prompt tokens if
    any, catch-up rows if any); empty for a record without them (an older JSON)."""
    if "mean_batch" not in v:
        return ""
    bits = [f"B {v['mean_batch']:.0f}"]
    if v.get("mean_prompt_tokens"):
        bits.append(f"P {v['mean_prompt_tokens']:.0f}")
    if v.get("catch_up_rows"):
        bits.append(f"catch-up {v['catch_up_rows']}")
    return " [" + ", ".join(bits) + "]"


def versus_best(wl: Dict[str, Any], arm: str = "adaptive") -> Optional[Dict[str, Any]]:
    """Issue 18's goal figure for one workload: ``arm``'s median output tok/s over the best other
    arm's (``ratio``, that arm's name ``best``) and the same within each round (``per_round``: run
    ``i`` of every arm; ``None`` where an arm lacks it or the best is 0) with their median
    (``per_round_median``: the paired figure, each round's arms run next to each other, so a host
    that changes speed between rounds moves it less than the ratio of medians; ``None`` without a
    complete round). ``None`` without ``arm``, without another arm, or when a median is missing or
    the best other median is 0."""
    arms = wl["arms"]
    others = [a for a in arms if a != arm]
    if arm not in arms or not others:
        return None
    med = {a: arms[a]["summary"]["output_throughput"]["median"] for a in arms}
    if med[arm] is None or any(med[a] is None for a in others) or not max(med[a] for a in others):
        return None
    best = max(others, key=lambda a: med[a])
    tput = {a: [r.get("output_throughput") for r in arms[a]["runs"]] for a in arms}
    per_round = []
    for i in range(max(len(t) for t in tput.values())):
        row = {a: (t[i] if i < len(t) else None) for a, t in tput.items()}
        ok = all(x is not None for x in row.values()) and max(row[a] for a in others) > 0
        per_round.append(row[arm] / max(row[a] for a in others) if ok else None)
    done = [r for r in per_round if r is not None]
    return {"arm": arm, "best": best, "ratio": med[arm] / med[best], "per_round": per_round,
            "per_round_median": statistics.median(done) if done else None}


def plot_workload(name: str, wl: Dict[str, Any], out_dir: str) -> List[str]:
    """PNGs: each arm's runs (output tok/s, steps/s; median bar and spread) and acceptance per position."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    synth = " [SYNTHETIC]" if wl["synthetic"] else ""
    arms = list(wl["arms"])
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key in zip(axes, ("output_throughput", "steps_per_s")):
        for x, arm in enumerate(arms):
            s = wl["arms"][arm]["summary"][key]
            vals = [v for v in s["runs"] if v is not None]
            n = len(vals)
            xs = [x + (i - (n - 1) / 2) * 0.08 for i in range(n)]
            ax.scatter(xs, vals, s=18, zorder=3, label="runs" if x == 0 else None)
            if s["median"] is not None:
                lo, hi = min(vals), max(vals)
                ax.errorbar([x], [s["median"]], yerr=[[s["median"] - lo], [hi - s["median"]]], fmt="_",
                            markersize=24, capsize=6, color="black", zorder=4,
                            label="median, spread" if x == 0 else None)
        ax.set_xticks(range(len(arms)), arms)
        ax.set_title(FIGURES[key][0])
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"mtpspec bench arms: {name}{synth}")
    fig.tight_layout()
    p = os.path.join(out_dir, f"{name}_runs.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in arms:
        rates = wl["arms"][arm]["summary"]["acceptance_rate_per_pos"]["median"]
        if rates and any(r is not None for r in rates):
            ax.plot(range(1, len(rates) + 1), [r if r is not None else float("nan") for r in rates], marker="o",
                    label=arm)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (accepted / drafts)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"acceptance per draft position: {name}{synth}")
    fig.tight_layout()
    p = os.path.join(out_dir, f"{name}_acceptance.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


def check_plotting() -> None:
    """Raise RuntimeError, one line naming ``--no-plots`` and the install command, when matplotlib
    (the ``[bench]`` extra) cannot be imported: checked before any server starts, so a sweep that
    wants plots does not run for hours and then fail to make them."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except Exception as exc:  # not installed, or broken (a failed import of one of its dependencies)
        raise RuntimeError(f"the plots need matplotlib, which cannot be imported ({type(exc).__name__}: {exc}): "
                           "pip install 'mtpspec[bench]' (or pip install matplotlib), or pass --no-plots") from None


def write_plots(result: Dict[str, Any], out_dir: str) -> List[str]:
    """Every workload's PNGs (:func:`plot_workload`) in ``out_dir``; their paths go to
    ``result["plots"]`` and ``bench_arms.json`` is written again with them. A workload whose plots
    fail (any error) is one warning line on stderr, the others are still plotted; the JSON is
    never lost to plotting (:func:`run_arms` writes it before)."""
    paths: List[str] = []
    for name, wl in result["workloads"].items():
        try:
            paths += plot_workload(name, wl, out_dir)
        except Exception as exc:
            print(f"warning: no plots for workload {name!r} ({type(exc).__name__}: {exc}); every figure is in "
                  f"{os.path.join(out_dir, 'bench_arms.json')}", file=sys.stderr)
    result["plots"] = paths
    _write_json(result, out_dir)
    return paths


def _write_json(result: Dict[str, Any], out_dir: str) -> None:
    """``bench_arms.json`` in ``out_dir``, written whole to a temporary file, then renamed (a write
    that fails midway leaves the previous copy)."""
    path = os.path.join(out_dir, "bench_arms.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------- driver
def check_workload_lengths(workloads: Dict[str, Any], server_kwargs: Dict[str, Any], arm: str) -> None:
    """Raise ValueError when a workload with a fixed ``input_len`` asks for more than arm ``arm``'s
    server context holds (``input_len + output_len > max_model_len``, the server's own 400 rule):
    ``max_model_len`` from the arm's flags, else the checkpoint's ``max_position_embeddings``
    capped at the engine default. Natural-length prompts are left to the run."""
    from mtpspec.config import ModelConfig
    from mtpspec.engine.arg_utils import DEFAULT_MAX_MODEL_LEN
    limit = server_kwargs.get("max_model_len")
    if limit is None:
        limit = min(ModelConfig.from_pretrained(server_kwargs["model"]).max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    for name, cfg in workloads.items():
        if cfg.input_len is not None and cfg.input_len + cfg.output_len > limit:
            raise ValueError(f"workload {name!r}: input {cfg.input_len} + output {cfg.output_len} tokens exceed arm "
                             f"{arm!r}'s max_model_len={limit}; lower --scale or raise --max-model-len in "
                             f"--server-args")


def check_workload_concurrency(workloads: Dict[str, Any], server_kwargs: Dict[str, Any], arm: str) -> None:
    """Raise ValueError when an ``--in-process`` workload runs more requests at once than arm
    ``arm``'s ``max_num_seqs`` (its flags', else the engine default), which
    :func:`~mtpspec.entrypoints.bench_inprocess.run_in_process` refuses: checked before any arm loads,
    not after the workloads before it have run."""
    cap = server_kwargs.get("max_num_seqs")
    for name, cfg in workloads.items():
        if cap is not None and cfg.max_concurrency > cap:
            raise ValueError(f"workload {name!r}: concurrency {cfg.max_concurrency} exceeds arm {arm!r}'s "
                             f"max_num_seqs={cap}; raise it with --server-args '--max-num-seqs "
                             f"{cfg.max_concurrency}' (or lower --scale / --max-concurrency)")


def run_arms(arms: Dict[str, List[str]], workloads: Dict[str, BenchConfig], repeats: int, out_dir: str,
             common: List[str], urls: Optional[Dict[str, str]] = None, progress: bool = True,
             plots: bool = True, share_gpu: bool = False, one_at_a_time: bool = False,
             warmup_rounds: int = 0, in_process: bool = False, forced: Optional[str] = None,
             equal_kv: bool = False, host_retries: int = 0, host_max_ms: float = 0.0) -> Dict[str, Any]:
    """Start the servers, run every workload ``repeats`` times per arm interleaved, summarise.

    Interleaved: timed round ``i`` of a workload runs every arm once, in :func:`round_order`'s order
    ``i`` (warm-up rounds keep the arms' order), so over ``len(arms)`` rounds (twice that for an odd
    count) each arm runs once in each position and right after each other arm equally often, and a drift
    of the host's speed spreads over the arms.

    Args:
        arms: name -> `mtpspec serve` flags, in comparison order.
        workloads: name -> :class:`BenchConfig`.
        repeats: runs per arm and workload (>= 1; >= 2 for verdicts).
        out_dir: where the JSON, plots and server logs go.
        common: `mtpspec serve` flags every arm gets (``--model`` etc.).
        urls: arm -> base URL of an already running server (those arms start none).
        progress, plots: progress bars; PNG plots (:func:`write_plots`: made after ``bench_arms.json``
            is written, so a plot that fails only warns; matplotlib is checked before any server
            starts, :func:`check_plotting`).
        share_gpu: the arms run at the same time and split 85% of the GPU (a server's
            ``--gpu-memory-utilization`` counts the memory other processes already use, so the
            i-th started (0-based) of ``n`` gets ``0.85 * (i + 1) / n``; not for an arm whose
            flags size its KV cache, nor under ``equal_kv``).
        equal_kv: every arm started here gets ``--num-kv-blocks`` for the same KV token capacity
            (:func:`equal_kv_blocks`; recorded as ``equal_kv_blocks``, arm -> blocks), except an
            arm whose flags size its cache. Nothing checks beforehand that the arms' caches fit
            the GPU together: an arm that does not fit fails to start with the engine's
            one-line memory error.
        one_at_a_time: one server at a time (for models of which the GPU holds one copy): arm
            after arm, each server started, every workload's runs made, stopped. Not interleaved:
            drift between arms is not spread over them (the JSON says ``"interleaved": false``).
        warmup_rounds: untimed whole runs of each workload on every arm before its timed runs
            (interleaved as they are): a workload's first full-length run can meet shapes its
            short warm-up waves did not (an H200 sweep of 2026-12-04 had the first round of
            each workload slower for every arm); not in the results.
        in_process: each arm an ``LLM`` in this process instead of a server, each run one
            ``LLM.generate`` with every request queued before the first step
            (:mod:`~mtpspec.entrypoints.bench_inprocess`; ``forced``: the forced-acceptance setting,
            re-armed before each run); ``common`` + the arm's flags are parsed as `mtpspec serve`'s.
        host_retries: an interleaved round whose host probes (:func:`host_probe_ms`, before and
            after each run) reach more than :data:`HOST_SPREAD_WARN` times the fastest probe of the
            sweep so far (one probe is taken before the first timed round) is run again, all its
            arms, up to this many times (the last try is kept whatever its probes). The probes alone
            decide, never the results, so no arm is favoured; the replaced runs are kept in the
            workload's ``host_perturbed_runs`` (arm -> runs).
        host_max_ms: stop the sweep (``RuntimeError``; the runs made so far stay in the partial
            JSON) after an interleaved round (any try) whose host probes' median is above this many
            ms: a host that slow reads no host-bound comparison, and retrying on it spends the
            device's time for nothing (2026-12-06: a whole 570 s sweep re-ran every round on
            probes of 19-26 ms against 11-12). 0: never.

    Returns:
        Everything, as written to ``bench_arms.json``.

    Raises:
        ValueError: ``repeats < 1``, a malformed or too small GSM8K dataset, a workload longer
            than an arm's context (:func:`check_workload_lengths`), an ``in_process`` workload wider than
            an arm's ``max_num_seqs`` (:func:`check_workload_concurrency`); FileNotFoundError: no GSM8K
            dataset; RuntimeError: ``plots`` without matplotlib (all checked before any server
            starts), a server did not come up.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup_rounds < 0:
        raise ValueError(f"warmup_rounds must be >= 0, got {warmup_rounds}")
    if host_retries < 0:
        raise ValueError(f"--host-retries must be >= 0, got {host_retries}")
    if host_retries and one_at_a_time:
        raise ValueError("--host-retries re-runs interleaved rounds; --one-arm-at-a-time has none (leave one out)")
    if not (host_max_ms >= 0 and math.isfinite(host_max_ms)):
        raise ValueError(f"--host-max-ms must be a finite number >= 0 (0: off), got {host_max_ms}")
    if host_max_ms and one_at_a_time:
        raise ValueError("--host-max-ms checks interleaved rounds; --one-arm-at-a-time has none (leave one out)")
    if plots:
        check_plotting()
    from mtpspec.entrypoints.bench_dataset import load_dataset
    for cfg in workloads.values():  # a missing or bad dataset is reported before any server starts
        if cfg.prompts == "gsm8k":
            load_dataset(cfg.dataset, 6 if cfg.input_len is None else 1)
    from mtpspec.entrypoints.serve import check_serve_args
    for arm, flags in arms.items():  # and a workload longer than an arm's context (or, in-process, wider)
        if arm not in (urls or {}):
            kwargs = check_serve_args(common + flags)
            check_workload_lengths(workloads, kwargs, arm)
            if in_process:
                check_workload_concurrency(workloads, kwargs, arm)
    kv_blocks: Dict[str, int] = {}
    if equal_kv:  # arms that set their own KV size keep it
        kv_blocks = equal_kv_blocks(workloads, {a: check_serve_args(common + f) for a, f in arms.items()
                                                if a not in (urls or {}) and not _sizes_kv(f)})
    os.makedirs(out_dir, exist_ok=True)
    partial = os.path.join(out_dir, PARTIAL_JSON)
    if os.path.exists(partial):  # an earlier killed sweep's runs must not pass for this one's
        os.remove(partial)
    urls = dict(urls or {})
    servers: Dict[str, ArmServer] = {}
    result: Dict[str, Any] = {"arms": {a: {"flags": f, "url": urls.get(a)} for a, f in arms.items()},
                              "common_server_args": common, "repeats": repeats, "interleaved": not one_at_a_time,
                              "warmup_rounds": warmup_rounds, "in_process": in_process,
                              "equal_kv_blocks": kv_blocks or None, "host_retries": host_retries,
                              "host_max_ms": host_max_ms, "workloads": {}}
    bar = None
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {w: {a: [] for a in arms} for w in workloads}
    perturbed: Dict[str, Dict[str, List[Dict[str, Any]]]] = {w: {a: [] for a in arms} for w in workloads}
    fastest = float("inf")  # the fastest host probe of the sweep so far (seeded before the first timed round)

    def save_partial() -> None:
        """The runs made so far and what they ran, in ``PARTIAL_JSON`` (written whole, then renamed:
        a sweep killed mid-write keeps the previous copy); a failed write only warns."""
        done = {"partial": True, **{k: result[k] for k in ("arms", "common_server_args", "repeats", "interleaved",
                                                            "warmup_rounds", "in_process", "equal_kv_blocks",
                                                            "shared_weights")},
                "workload_configs": {w: c.as_json() for w, c in workloads.items()},
                "synthetic": any(r["synthetic_reasons"] for per in runs.values() for rs in per.values() for r in rs),
                "runs": runs, "host_retries": host_retries, "host_max_ms": host_max_ms,
                "host_perturbed_runs": perturbed}
        try:
            with open(partial + ".tmp", "w") as f:
                json.dump(done, f)
            os.replace(partial + ".tmp", partial)
        except OSError as exc:
            print(f"warning: could not save the runs so far to {partial}: {exc}", file=sys.stderr)

    engines: Dict[str, Any] = {}
    # in-process arms of one model hold its weights once (loader.sharing_weights) where they coexist and each
    # KV cache is sized in blocks (--equal-kv-blocks); a spawned rank (tp > 1) loads in its own process: no sharing
    shared_weights: Dict[str, Any] = {}
    share_weights = in_process and not one_at_a_time and all(a in kv_blocks for a in arms if a not in urls)
    result["shared_weights"] = share_weights

    def start(arm: str, i: int, n: int) -> None:
        flags, share = arms[arm], 0.85 * (i + 1) / n
        if arm in kv_blocks:  # the same token capacity for every arm (equal_kv_blocks)
            flags = flags + ["--num-kv-blocks", str(kv_blocks[arm])]
        elif share_gpu and n > 1 and not _sizes_kv(flags):
            flags = flags + ["--gpu-memory-utilization", f"{share:.4f}"]
        if in_process:
            from mtpspec.entrypoints.bench_inprocess import open_arm
            from mtpspec.entrypoints.serve import check_serve_args
            print(f"loading arm {arm!r} in this process ...", file=sys.stderr, flush=True)
            from mtpspec.models.loader import sharing_weights
            try:
                # only arms that coexist, each KV cache sized in blocks: a share of the GPU each
                # (--gpu-memory-utilization) assumes each arm holds its own weights
                with sharing_weights(shared_weights) if share_weights else contextlib.nullcontext():
                    engines[arm] = open_arm(check_serve_args(common + flags), forced)
            except (ValueError, RuntimeError) as exc:  # which arm (its flags) in the one line
                said = f"arm {arm!r} ({' '.join(flags) or 'no flags of its own'}): {exc}"
                raise (ValueError(said) if isinstance(exc, ValueError) else RuntimeError(said)) from exc
            return
        print(f"starting the server for arm {arm!r} ...", file=sys.stderr, flush=True)
        try:
            servers[arm] = ArmServer(arm, flags, common, os.path.join(out_dir, f"server_{arm}.log"))
        except RuntimeError as exc:
            if share_gpu and n > 1 and "memory" in str(exc):  # all up at once, each with a share of the GPU
                raise RuntimeError(f"{exc}\n(the {n} servers share the GPU, this one {share:.0%} of it: "
                                   "for a model the GPU holds one copy of, use --one-arm-at-a-time)") from None
            raise
        urls[arm] = servers[arm].url
        result["arms"][arm]["url"] = urls[arm]

    def one(wname: str, cfg: BenchConfig, arm: str, desc: str) -> Dict[str, Any]:
        if in_process:
            from mtpspec.entrypoints.bench_inprocess import run_in_process
            return run_in_process(engines[arm], cfg, forced, profile_tag=f"{wname}_{arm}")
        return run_benchmark(urls[arm], cfg, progress=progress, desc=desc)

    def warm(wname: str, cfg: BenchConfig, arm: str, i: int) -> None:
        one(wname, cfg, arm, f"{wname} {arm} warm-up #{i + 1}")

    def run(wname: str, cfg: BenchConfig, arm: str, rep: int) -> None:
        before = host_probe_ms()
        res = one(wname, cfg, arm, f"{wname} {arm} #{rep + 1}")
        res["host_probe_ms"] = [before, host_probe_ms()]
        res["run_index"] = rep
        runs[wname][arm].append(res)
        save_partial()
        if bar is not None:
            bar.update(1)

    try:
        to_start = [a for a in arms if a not in urls]
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=repeats * len(arms) * len(workloads), desc="bench arms", unit="run", dynamic_ncols=True,
                       file=sys.stderr)
        if one_at_a_time:
            for arm in arms:
                if arm in to_start:
                    start(arm, 0, 1)
                for wname, cfg in workloads.items():
                    for i in range(warmup_rounds):
                        warm(wname, cfg, arm, i)
                    for rep in range(repeats):
                        run(wname, cfg, arm, rep)
                if arm in servers:
                    servers.pop(arm).stop()
                if arm in engines:
                    engines.pop(arm).shutdown()
        else:
            for i, arm in enumerate(to_start):
                start(arm, i, len(to_start))
            for wname, cfg in workloads.items():
                for i in range(warmup_rounds):
                    for arm in arms:
                        warm(wname, cfg, arm, i)
                if host_retries and fastest == float("inf"):
                    fastest = host_probe_ms()  # a sweep starting on a slowed host still has a fast reference
                for rep in range(repeats):
                    for attempt in range(host_retries + 1):
                        for arm in round_order(list(arms), rep):  # interleaved, carry-over balanced
                            run(wname, cfg, arm, rep)
                        probes = [p for arm in arms for p in runs[wname][arm][-1]["host_probe_ms"]]
                        if host_max_ms and statistics.median(probes) > host_max_ms:
                            raise RuntimeError(
                                f"{wname} round {rep + 1}: the host probes' median, {statistics.median(probes):.1f} "
                                f"ms, is above --host-max-ms {host_max_ms:g}: this host is too slow for host-bound "
                                "comparisons; the sweep stopped")
                        fastest = min(fastest, *probes)
                        if attempt == host_retries or max(probes) <= HOST_SPREAD_WARN * fastest:
                            break
                        print(f"{wname} round {rep + 1}: the host probes reached {max(probes):.1f} ms against the "
                              f"sweep's fastest so far, {fastest:.1f} ms; running the round again", file=sys.stderr)
                        for arm in arms:  # the whole round, every arm alike
                            perturbed[wname][arm].append(runs[wname][arm].pop())
                        if bar is not None:
                            bar.total += len(arms)
        for wname, cfg in workloads.items():
            per_arm = runs[wname]
            reasons = sorted({r for done in per_arm.values() for res in done for r in res["synthetic_reasons"]})
            wl: Dict[str, Any] = {"config": cfg.as_json(), "repeats": repeats, "synthetic": bool(reasons),
                                  "synthetic_reasons": reasons, "arms": {}, "verdicts": {}}
            for arm, done in per_arm.items():
                wl["arms"][arm] = {"runs": done, "summary": summarise(done)}
            names = list(arms)
            for i in range(len(names)):
                for j in range(i + 1, len(names)):
                    a, b = names[i], names[j]
                    wl["verdicts"][f"{b} vs {a}"] = {
                        key: verdict(wl["arms"][a]["summary"][key], wl["arms"][b]["summary"][key], hib, repeats)
                        for key, (_, hib) in FIGURES.items()}
            vs = versus_best(wl)
            if vs is not None:
                wl["adaptive_vs_best"] = vs
            wl["host_probe"] = host_spread(wl)
            if any(perturbed[wname].values()):
                wl["host_perturbed_runs"] = perturbed[wname]
            result["workloads"][wname] = wl
    finally:
        if bar is not None:
            bar.close()
        for s in servers.values():
            s.stop()
        for e in engines.values():
            e.shutdown()
        shared_weights.clear()
    result["synthetic"] = any(w["synthetic"] for w in result["workloads"].values())
    _write_json(result, out_dir)  # before any plot: a failed plot must not lose the sweep
    if os.path.exists(partial):
        os.remove(partial)
    if plots:
        write_plots(result, out_dir)
    return result


def add_parser(sub: Any) -> None:
    p = sub.add_parser("arms", help="A/B of engine arms (one server per arm, interleaved runs, verdicts)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parse_known_args = p.parse_known_args  # the subcommand's parser gets its words through this

    def parse_known_args_joined(args: Optional[Sequence[str]] = None, namespace: Any = None) -> Any:
        args = sys.argv[1:] if args is None else list(args)
        if args and args[-1] == "--server-args":
            p.error(f"argument --server-args: expected one value, the `mtpspec serve` flags: {SERVER_ARGS_FORMS}")
        return parse_known_args(join_server_args(args), namespace)

    p.parse_known_args = parse_known_args_joined  # type: ignore[method-assign]
    p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled demo model)")
    p.add_argument("--arms", default="baseline,fusion,both",
                   help="comma-separated arm names, in comparison order (default: baseline,fusion,both)")
    p.add_argument("--arm", action="append", default=[], metavar="NAME=FLAGS",
                   help="define an arm by its `mtpspec serve` flags (repeatable; FLAGS split as --server-args is), "
                        "e.g. an adaptive arm with a saved step-cost table: 'adtab=--speculative-config "
                        "{\"num_speculative_tokens\": 3, \"adaptive\": true, \"adaptive_cost_table\": \"costs.json\"}' "
                        "(--server-args apply to every arm)")
    p.add_argument("--base-url", action="append", default=[], metavar="NAME=URL",
                   help="use an already running server for arm NAME (repeatable)")
    p.add_argument("--workloads", default="batch1,c64",
                   help=f"comma-separated presets: {', '.join(PRESETS)} (default: batch1,c64)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply the presets' lengths and prompt counts, in (0, 1] (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="runs per arm and workload (default 3)")
    p.add_argument("--in-process", action="store_true",
                   help="each arm an LLM in this process, each run one LLM.generate with every request queued "
                        "before the first step (deterministic arrival; no HTTP, TTFT / ITL from the engine); with "
                        "--equal-kv-blocks (tp 1) the arms hold the model's weights once (parameters equal in "
                        "value are shared)")
    p.add_argument("--equal-kv-blocks", action="store_true",
                   help="give every arm --num-kv-blocks for the same KV token capacity, enough for every "
                        "workload's concurrent requests whole (instead of a share of the GPU each, in which a "
                        "speculative or adaptive arm holds fewer tokens than plain decoding; arms given by URL "
                        "keep their server's; nothing checks beforehand that the arms fit together)")
    p.add_argument("--warmup-rounds", type=int, default=0,
                   help="untimed whole runs of each workload per arm before the timed ones (default 0)")
    p.add_argument("--host-retries", type=int, default=0, metavar="N",
                   help="run an interleaved round again (all its arms, up to N times) when its host-speed probes "
                        f"reach more than {HOST_SPREAD_WARN}x the sweep's fastest so far (a shared host slowed down); the "
                        "probes alone decide, never the results (default 0: every round kept)")
    p.add_argument("--host-max-ms", type=float, default=0.0, metavar="MS",
                   help="stop the sweep after an interleaved round whose host-speed probes' median is above MS "
                        "(the runs so far stay in the partial JSON; default 0: never)")
    p.add_argument("--server-args", default="", metavar="FLAGS",
                   help="extra `mtpspec serve` flags for every arm, one value (checked before any server starts): "
                        "--server-args '-tp 2 --allreduce-backend p2p', --server-args --enforce-eager (the word "
                        "after --server-args is always its value), --server-args='...'; split as a shell splits "
                        "words, a JSON object kept as written: --server-args '--speculative-config "
                        "{\"num_speculative_tokens\": 3}'")
    p.add_argument("--forced-acceptance", default=None, metavar="rate:P|length:N",
                   help="passed to every server (SYNTHETIC, for random-weight models)")
    p.add_argument("--output-dir", default="bench_arms_out",
                   help="JSON, plots and server logs (default: bench_arms_out)")
    p.add_argument("--no-plots", action="store_true",
                   help="no PNG plots (they need matplotlib: pip install 'mtpspec[bench]'; without it and without "
                        "this flag the sweep stops before any server starts)")
    p.add_argument("--one-arm-at-a-time", action="store_true",
                   help="one server at a time, arm after arm (models the GPU holds one copy of; runs not interleaved)")
    add_arguments(p)


def run(args: argparse.Namespace) -> int:
    import httpx

    from mtpspec.entrypoints.serve import default_model_path
    started = time.time()  # a bench_arms.partial.json older than this is an earlier sweep's
    try:
        if args.repeats < 1:  # (run_arms' own check names its argument)
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        arms = parse_arms(args.arms, args.arm)
        urls = {}
        for spec in args.base_url:
            name, sep, url = spec.partition("=")
            if not sep or name not in arms:
                raise ValueError(f"--base-url must be NAME=URL with NAME one of {list(arms)}, got {spec!r}")
            if name in urls:  # (the later one replaced the earlier, silently)
                raise ValueError(f"--base-url names the arm {name!r} twice ({urls[name]} and {url}); "
                                 "one server per arm")
            urls[name] = url
        if urls and args.in_process:
            raise ValueError("--base-url and --in-process exclude each other (a URL is another process's server)")
        workloads = {}
        for w in parse_workloads(args.workloads):
            workloads[w] = workload_config(w, args)
        if args.in_process and args.request_rate != math.inf:
            raise ValueError(f"--request-rate {args.request_rate:g}: --in-process queues every request before the "
                             "first step (no arrivals to pace); drop one")
        try:
            common = ["--model", args.model or default_model_path()] + split_flags(args.server_args)
        except ValueError as exc:  # an unclosed quote
            raise ValueError(f"--server-args {args.server_args!r}: {exc}; write it as {SERVER_ARGS_FORMS}") from None
        if args.forced_acceptance:
            from mtpspec.spec_decode.forced_acceptance import ForcedAcceptance
            try:  # its value too, before any server starts (serve checks it only when it builds the engine)
                ForcedAcceptance.parse(args.forced_acceptance)
            except ValueError as exc:
                raise ValueError(f"--forced-acceptance: {exc}") from None
            common += ["--forced-acceptance", args.forced_acceptance]
        from mtpspec.entrypoints.serve import check_serve_args
        for name, arm_flags in arms.items():  # a bad flag fails here, before any server starts
            try:
                check_serve_args(common + arm_flags)
            except ValueError as exc:  # named by where it came from (some flags are valid only with an arm's)
                try:
                    check_serve_args(common)
                    where = f"arm {name!r} ({' '.join(arm_flags) or 'no flags'})"
                except ValueError as common_exc:
                    where = "--server-args / --model" if str(common_exc) == str(exc) else \
                        f"arm {name!r} ({' '.join(arm_flags) or 'no flags'}) with --server-args"
                hint = ""
                if "invalid JSON" in str(exc):  # say how the value was split: quotes the shell's rules removed
                    hint = (f" (--server-args split into {split_flags(args.server_args)}"
                            + (f", arm {name!r}'s flags {arm_flags}" if where.startswith("arm") else "")
                            + f"; JSON in --server-args or --arm is kept as written when it is valid JSON, e.g. "
                              f"{SERVER_ARGS_JSON_FORM})")
                raise ValueError(f"{where}: {exc}{hint}") from None
        if not args.no_plots:  # before any server starts: a sweep must not end without its plots
            check_plotting()
        if args.equal_kv_blocks and _sizes_kv(common):
            raise ValueError("--equal-kv-blocks sizes every arm's KV cache: drop --gpu-memory-utilization / "
                             "--num-kv-blocks from --server-args (an arm's own flags may still set them)")
        share = not args.one_arm_at_a_time and not args.equal_kv_blocks and not _sizes_kv(common)
        res = run_arms(arms, workloads, args.repeats, args.output_dir, common, urls, progress=not args.no_progress,
                       plots=False, share_gpu=share, one_at_a_time=args.one_arm_at_a_time,
                       warmup_rounds=args.warmup_rounds, in_process=args.in_process,
                       forced=args.forced_acceptance if args.in_process else None,
                       equal_kv=args.equal_kv_blocks, host_retries=args.host_retries,
                       host_max_ms=args.host_max_ms)
    except (ValueError, FileNotFoundError, RuntimeError, httpx.HTTPError) as exc:
        what = f"talking to a server: {type(exc).__name__}: {exc}" if isinstance(exc, httpx.HTTPError) else exc
        print(f"error: {what}", file=sys.stderr)
        partial = os.path.join(args.output_dir, PARTIAL_JSON)
        if os.path.exists(partial) and os.path.getmtime(partial) >= started - 1.0:
            print(f"the runs made before it: {partial}", file=sys.stderr)  # this sweep's, not an earlier one's
        return 2
    for name, wl in res["workloads"].items():  # the tables (and the JSON, written) before any plot
        print(format_workload(name, wl), flush=True)
    plots = [] if args.no_plots else write_plots(res, args.output_dir)
    print(f"\nevery figure: {os.path.join(args.output_dir, 'bench_arms.json')}"
          + (f"; plots: {', '.join(plots)}" if plots else ""))
    return 0

"""`mtpspec serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) with MTP speculative decoding.

Engine flags: :class:`mtpspec.engine.arg_utils.EngineArgs` (vLLM's spellings, shared with
``mtpspec generate``). Without ``--model`` the bundled demo model
is served. Endpoints, errors and metrics: :mod:`mtpspec.entrypoints.openai_server`.

Example::

    mtpspec serve --tensor-parallel-size 2 --speculative-config '{"method": "mtp", "num_speculative_tokens": 3, "use_local_argmax_reduction": true}' --port 8000
    mtpspec serve -tp 2 -k 3 --port 8000          # the same, short flags
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "Question: 2+3?\\nAnswer:", "max_tokens": 32, "temperature": 0}'

``--forced-acceptance rate:0.7`` (or ``length:2``) makes the verifier accept drafts at a set
rate or a fixed length: SYNTHETIC, for kernel A/B runs on random-weight models only (see
:mod:`mtpspec.spec_decode.forced_acceptance`); the server reports it in ``/v1/models`` and
``/metrics``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from typing import Any, Dict, Optional


#: Seconds between the engine's death and the server's exit (in-flight requests get their errors).
ENGINE_DEAD_GRACE_S = 1.0


def default_model_path() -> str:
    """The default bundled demo model's folder: ``mtpspec.demo_model_path()`` when the package has
    it, else ``mtpspec/demo_model_glm5`` (it may not exist)."""
    import mtpspec
    fn = getattr(mtpspec, "demo_model_path", None)
    if callable(fn):
        return str(fn())
    return os.path.join(os.path.dirname(os.path.abspath(mtpspec.__file__)), "demo_model_glm5")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags of :class:`~mtpspec.engine.arg_utils.EngineArgs` (shared with
    ``mtpspec generate`` and ``mtpspec eval gsm8k --model``)."""
    from mtpspec.engine.arg_utils import EngineArgs
    EngineArgs.add_cli_args(p)


def llm_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """``LLM(**kwargs)`` from :func:`add_engine_args` options (``model`` resolved).

    Raises:
        ValueError: a bad ``-k`` / ``--speculative-config`` or a conflict between them.
    """
    from mtpspec.engine.arg_utils import EngineArgs
    return EngineArgs.from_cli_args(args).llm_kwargs()


def _int_in(value: str, lo: int, hi: Optional[int] = None) -> int:
    """``value`` as an int in ``[lo, hi]`` (``hi=None``: no upper bound).

    Raises:
        argparse.ArgumentTypeError: not an int, or outside the range (argparse names the flag)."""
    try:
        n = int(value)
    except ValueError:
        n = lo - 1
    if n < lo or (hi is not None and n > hi):
        raise argparse.ArgumentTypeError(f"must be an int in [{lo}, {hi}], got {value!r}" if hi is not None
                                         else f"must be an int >= {lo}, got {value!r}")
    return n


def port_number(value: str) -> int:
    """``--port``: an int in [0, 65535] (0: any free port)."""
    return _int_in(value, 0, 65535)


def positive_int(value: str) -> int:
    """An int >= 1 (``--torch-threads``, ``--max-queue-len``)."""
    return _int_in(value, 1)


def non_negative_ms(value: str) -> float:
    """A finite float >= 0 (milliseconds).

    Raises:
        argparse.ArgumentTypeError: not a number, negative, NaN or infinite."""
    try:
        x = float(value)
    except ValueError:
        x = -1.0
    if not 0.0 <= x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value!r}")
    return x


def json_str_list(value: str) -> list:
    """A JSON list of strings (vLLM's ``--allowed-origins '["http://a.b"]'`` and the other CORS lists).

    Raises:
        argparse.ArgumentTypeError: not JSON, or not a list of strings."""
    try:
        x = json.loads(value)
    except ValueError:
        x = None
    if not isinstance(x, list) or not all(isinstance(v, str) for v in x):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, e.g. '[\"*\"]', got {value!r}")
    return x


#: uvicorn's log levels (``--log-level``, vLLM's ``--uvicorn-log-level``).
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` the way uvicorn binds one (IPv6 when ``host`` has a ``:``,
    ``SO_REUSEADDR`` on as uvicorn sets it, so a port left in TIME_WAIT by a previous server is not
    refused while a port another process listens on is).

    Raises:
        OSError: it cannot be bound.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def check_serve_args(argv: Any) -> Dict[str, Any]:
    """Check that ``argv`` (a list of strings) are valid ``mtpspec serve`` flags, engine flags
    combining without conflict, before any server starts (``bench arms --server-args``).

    Returns:
        The ``LLM(...)`` keyword arguments those flags give (``model`` resolved).

    Raises:
        ValueError: an unknown flag, a bad value, conflicting speculative flags (named), or a model
            whose config.json cannot be split over the flags' ``--tensor-parallel-size``.
    """
    kwargs = llm_kwargs(parse_serve_flags(argv))
    if os.path.isfile(os.path.join(kwargs["model"], "config.json")):  # a missing one: the server says so
        from mtpspec.config import ModelConfig
        ModelConfig.from_pretrained(kwargs["model"]).verify_tensor_parallel(kwargs.get("tensor_parallel_size") or 1)
    return kwargs


def parse_serve_flags(argv: Any) -> argparse.Namespace:
    """``argv`` (a list of strings) parsed as ``mtpspec serve``'s flags (abbreviations resolved),
    without checking how they combine (:func:`check_serve_args` does).

    Raises:
        ValueError: an unknown flag or a bad value (argparse's message).
    """
    parser = _RaisingParser(prog="mtpspec", add_help=False)
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    return parser.parse_args(["serve", *argv])


def engine_info(args: argparse.Namespace, kwargs: Dict[str, Any], forced: Optional[Any]) -> Dict[str, Any]:
    """The configuration a client can read back (``/v1/models`` -> ``mtpspec``); :func:`build`
    replaces ``max_num_batched_tokens`` and ``dtype`` by the values the engine resolved."""
    spec = kwargs["speculative_config"] or {}
    k = int(spec.get("num_speculative_tokens", 1)) if spec else 0
    return {"model": kwargs["model"], "tp": kwargs["tensor_parallel_size"], "num_speculative_tokens": k,
            "fusion": kwargs["fuse_allreduce_rmsnorm"] and k > 0,
            "local_argmax": bool(spec.get("use_local_argmax_reduction", False)) and k > 0,
            "adaptive": bool(spec.get("adaptive", False)) and k > 0,
            # adaptive k = 0 steps defer their MTP KV entries (the default; false: the adaptive_eagerkv arm)
            "adaptive_defer_mtp_kv": bool(spec.get("adaptive", False)) and k > 0
            and spec.get("adaptive_defer_mtp_kv") is not False,
            "sequence_parallel": kwargs["sequence_parallel"], "allreduce_backend": kwargs["allreduce_backend"],
            "max_num_seqs": kwargs["max_num_seqs"], "enable_chunked_prefill": kwargs["enable_chunked_prefill"],
            "max_num_batched_tokens": kwargs["max_num_batched_tokens"] or "derived",
            "long_prefill_token_threshold": kwargs["long_prefill_token_threshold"],
            "enable_prefix_caching": kwargs["enable_prefix_caching"], "kv_cache_dtype": kwargs["kv_cache_dtype"],
            "dtype": kwargs["dtype"] or "checkpoint",
            "seed": kwargs["seed"], "forced_acceptance": forced.describe() if forced else "off",
            "enable_prompt_tokens_details": bool(getattr(args, "enable_prompt_tokens_details", False)),
            "synthetic": forced is not None}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server (FastAPI + uvicorn)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model folder, as `vllm serve MODEL` takes it (same as --model)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000,
                   help="TCP port, 0..65535 (default 8000; 0: any free port, named in the start-up line)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients send, any of them accepted, a response naming its request's (default: "
                        "--model as given; mtpspec-demo without --model)")
    p.add_argument("--max-queue-len", type=positive_int, default=1024,
                   help="most requests waiting to be scheduled; one more gets 503 (default 1024)")
    p.add_argument("--forced-acceptance", default=None, metavar="rate:P|length:N",
                   help="SYNTHETIC: verifier accepts drafts at rate P or a fixed length N (kernel A/B on "
                        "random-weight models)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="vLLM's flag: usage.prompt_tokens_details.cached_tokens (prompt tokens the prefix cache "
                        "served) in responses, when non-zero (default off)")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="the Jinja chat template for /v1/chat/completions: a file, or the template itself in "
                        "single-line form (default: the tokenizer's own, else the plain Question:/Answer: template)")
    p.add_argument("--api-key", default=None,
                   help="vLLM's flag: /v1 requests (and /reset_prefix_cache) must send 'Authorization: Bearer "
                        "<key>' (401 otherwise); /health, /metrics, /version, /tokenize and /detokenize stay open; "
                        "mtpspec's clients (bench, eval --base-url) send $OPENAI_API_KEY (default: no key)")
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "headers")):
        p.add_argument(flag, type=json_str_list, default=["*"],
                       help=f"vLLM's CORS flag: the allowed {what}, a JSON list (default '[\"*\"]')")
    p.add_argument("--allow-credentials", action="store_true", help="vLLM's CORS flag: allow credentials")
    p.add_argument("--disable-log-requests", "--disable-log-stats", dest="_vllm_log_flags", action="store_true",
                   help="accepted so vLLM command lines run unchanged: mtpspec serve logs neither a line per request "
                        "nor periodic stats (the flags change nothing; --log-level sets uvicorn's)")
    p.add_argument("--first-output-handoff-ms", type=non_negative_ms, default=0.0,
                   help="after a step with some request's first token (and at most 8 outputs), the engine thread waits "
                        "up to this long for the HTTP thread to send it before preparing the next step (GIL "
                        "hand-off; default 0: off, no gain measured on an H200)")
    p.add_argument("--torch-threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", type=str.lower, choices=LOG_LEVELS,
                   default="warning", help="uvicorn log level (default warning)")
    p.add_argument("--debug-fault-marker", default=None, help=argparse.SUPPRESS)


def build(args: argparse.Namespace) -> Any:
    """Construct the engine and the app; returns ``(app, async_llm, info)``.

    Raises:
        ValueError / TypeError: a bad option (from ``LLM`` or the forced-acceptance setting).
    """
    from mtpspec.config import _dtype_from_name
    from mtpspec.engine.async_llm import AsyncLLM
    from mtpspec.engine.llm import LLM
    from mtpspec.entrypoints.openai_server import ServerContext, build_app
    from mtpspec.entrypoints.server_metrics import ServerMetrics
    from mtpspec.spec_decode.forced_acceptance import ForcedAcceptance, enable_forced_acceptance

    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            raise ValueError(f"the model is given twice: {tag!r} (positional) and --model {args.model!r}")
        args.model = tag
    if getattr(args, "api_key", None) == "":
        raise ValueError("--api-key must not be empty (leave it out for a server without a key)")
    forced = ForcedAcceptance.parse(args.forced_acceptance) if args.forced_acceptance else None
    from mtpspec.entrypoints.chat_template import load_chat_template
    template = load_chat_template(args.chat_template) if getattr(args, "chat_template", None) is not None else None
    kwargs = llm_kwargs(args)
    from mtpspec.engine.arg_utils import model_path_problem
    why = model_path_problem(kwargs["model"], explicit=bool(args.model))
    if why is not None:
        raise ValueError(why)
    try:
        llm = LLM(**kwargs)
    except FileNotFoundError as exc:  # e.g. no weights in the folder: a user error like the others
        raise ValueError(str(exc)) from exc
    try:
        if template is not None:
            if llm.get_tokenizer() is None:
                raise ValueError("--chat-template needs a tokenizer; the model folder has none (give --tokenizer)")
            llm.get_tokenizer().chat_template = template
        if forced is not None and llm.llm_engine.scheduler_config.num_speculative_tokens:
            enable_forced_acceptance(llm, forced)
        elif forced is not None:  # plain decoding (e.g. a bench arms "plain" arm): no drafts to force
            print("mtpspec serve: --forced-acceptance has nothing to do without speculative decoding (k = 0); "
                  "the run is still marked SYNTHETIC", file=sys.stderr)
        engine = AsyncLLM(llm, max_queue_len=args.max_queue_len,
                          first_output_handoff_s=args.first_output_handoff_ms / 1e3)
    except BaseException:
        llm.shutdown()
        raise
    if args.debug_fault_marker:
        marker = args.debug_fault_marker

        def fault(out: Any) -> None:
            if out.prompt is not None and marker in out.prompt and out.outputs[0].token_ids:
                raise RuntimeError(f"injected fault (prompt contains {marker!r})")
        engine.fault_injector = fault
    info = engine_info(args, kwargs, forced)
    info["max_model_len"] = engine.max_model_len
    ec = llm.engine_config  # the values in use, not "derived" / "checkpoint"
    info["max_num_batched_tokens"] = ec.scheduler_config.max_num_batched_tokens
    info["dtype"] = str(_dtype_from_name(ec.dtype or ec.model_config.dtype or "float32")).replace("torch.", "")
    info["num_kv_blocks"] = engine.stats().num_total_blocks
    info["allreduce_backend"] = _allreduce_in_use(info, ec.device)
    # what requests that leave sampling fields unset get (generation_config.json; --generation-config)
    info["default_sampling_params"] = dict(llm.default_sampling_fields) or "none"
    name = args.served_model_name or [args.model or "mtpspec-demo"]
    metrics = ServerMetrics(engine.num_speculative_tokens, info, forced_acceptance=forced is not None,
                            model_name=name[0])
    ctx = ServerContext(engine, name, kwargs["model"], info, metrics,
                        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                        api_key=getattr(args, "api_key", None),
                        cors={"allow_origins": args.allowed_origins, "allow_credentials": args.allow_credentials,
                              "allow_methods": args.allowed_methods, "allow_headers": args.allowed_headers})
    return build_app(ctx), engine, info


def _allreduce_in_use(info: Dict[str, Any], device: Optional[str]) -> str:
    """The all-reduce backend the engine runs, as the banner, ``/v1/models`` and ``/metrics`` report
    it: ``"none (tp 1)"``; ``--allreduce-backend nccl`` is torch.distributed's collectives, NCCL on
    GPUs and gloo on the CPU; ``"p2p"`` as given."""
    if info["tp"] == 1:
        return "none (tp 1)"
    if info["allreduce_backend"] != "nccl":
        return info["allreduce_backend"]
    import torch
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return "nccl" if str(device).startswith("cuda") else "gloo"


def _server_class(uvicorn: Any, on_exit: Optional[Any] = None) -> type:
    """``uvicorn.Server`` that remembers a SIGINT and calls ``on_exit()`` on the first exit signal.
    After its graceful shutdown uvicorn re-raises the signal, but under ``asyncio.run`` that re-raise
    only cancels the serving task, which may already be finishing: then no ``KeyboardInterrupt``
    comes out and Ctrl-C looked like a clean exit (exit 0, seen once in 1,500 test runs under load).
    ``on_exit`` ends the requests in flight (:meth:`AsyncLLM.fail_all`): a long stream would otherwise
    hold the graceful shutdown for its whole timeout and then be cancelled with a traceback."""
    import signal

    class _Server(uvicorn.Server):
        got_sigint = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if sig == signal.SIGINT:
                self.got_sigint = True
            if on_exit is not None and not self.should_exit:
                on_exit()
            super().handle_exit(sig, frame)

    return _Server


def run(args: argparse.Namespace) -> int:
    """Serve until an exit signal or the engine's death.

    Returns 2 (``error: ...``) for a port that cannot be listened on or a bad option (a
    ``ValueError`` / ``TypeError`` of :func:`build`, e.g. a KV cache that does not fit in memory),
    0 after SIGTERM. Ctrl-C (exit status 130) and a dead engine (a rank died, a step failed:
    ``error: ...; the server shut down``, status 1) end the process with ``os._exit`` once the
    engine is shut down and stdout / stderr are flushed, skipping the interpreter's teardown."""
    import uvicorn

    if args.torch_threads:
        import torch
        torch.set_num_threads(args.torch_threads)
    # the port is bound before the model loads and held until uvicorn listens on it (as vLLM does): a
    # tensor-parallel launch picks free ports for its ranks meanwhile, and a port only checked and
    # released could be handed to them (a CPU test run, 2026-12-06: "address already in use" at -tp 2)
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        app, engine, info = build(args)
    except (ValueError, TypeError) as exc:
        sock.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BaseException:
        sock.close()
        raise
    # The model, its tokenizer, the graphs and the app are built: every object alive now out of the
    # cyclic collector's passes (mtpspec.engine.gc_heap; the engine froze its own at start-up)
    from mtpspec.engine.gc_heap import freeze_gc_heap
    freeze_gc_heap()
    synth = "  [SYNTHETIC: forced acceptance " + info["forced_acceptance"] + "]" if info["synthetic"] else ""
    port = sock.getsockname()[1]  # (port 0: the free one bound above, which the banner names)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"mtpspec serve: {info['model']} (tp {info['tp']}, k {info['num_speculative_tokens']}, fusion "
          f"{info['fusion']}, local argmax {info['local_argmax']}, all-reduce {info['allreduce_backend']}, "
          f"{info['num_kv_blocks']} KV blocks){synth} on "
          f"http://{host}:{port}", file=sys.stderr, flush=True)
    server = _server_class(uvicorn, lambda: engine.fail_all("the server is shutting down"))(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5))
    stop = threading.Event()

    def watch() -> None:  # a dead engine cannot recover: exit (as vLLM does) so a supervisor can restart us
        while not stop.wait(0.2):
            if engine.check_ranks() is not None:  # also a rank that died while the engine was idle
                time.sleep(ENGINE_DEAD_GRACE_S)  # the in-flight requests receive their errors first
                server.should_exit = True
                return

    watcher = threading.Thread(target=watch, name="mtpspec-engine-watch", daemon=True)
    watcher.start()
    interrupted = False
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C: uvicorn shut down gracefully, then re-raised the signal
        interrupted = True
    finally:
        stop.set()
        engine.shutdown()
    if interrupted or server.got_sigint:  # the re-raised signal may be lost (see _server_class)
        print("mtpspec serve: interrupted; the server shut down", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # 128 + SIGINT, as a shell reports it; skip the interpreter's teardown, where native extensions
        # (Triton's nanobind types) print leak warnings that read like a crash
        os._exit(130)
    if engine.dead is not None:
        print(f"error: {engine.dead}; the server shut down", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # as after Ctrl-C: no interpreter teardown and its native leak warnings (exit status 1)
    return 0

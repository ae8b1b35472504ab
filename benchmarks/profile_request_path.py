"""Host time of one streamed request through `mtpspec serve`, phase by phase (issue 17).

Runs the real server (``serve.build`` + uvicorn) in this process on CPU with a bundled demo
model, sends the same 5-shot GSM8K prompt (707 tokens with the demo tokenizer) again and again
(every request after the first hits the prefix cache) as a streamed ``/v1/completions`` request, and stamps each phase
with ``time.perf_counter`` (one clock for the client, the asyncio thread and the engine thread):

==========================  =====================================================================
phase                       from -> to
==========================  =====================================================================
``http_in``                 client sent the request -> handler starts (uvicorn / h11 parse)
``asgi``                    of which: ASGI app called -> handler starts (FastAPI / Starlette)
``handler``                 handler starts -> prompt validated (JSON, pydantic, checks, tokenize)
``parse``                   of which: body read, JSON and pydantic (``_parse``)
``tokenize``                of which: ``Tokenizer.encode`` of the prompt
``queue_put``               validated -> ``AsyncLLM.add_request`` returned (command queued)
``engine_pickup``           validated -> engine thread applies the ``add`` command
``engine_add``              engine thread: the ``add`` command (``LLMEngine.add_request``)
``to_schedule``             ``add`` applied -> first step schedules the request
``step``                    scheduled -> first token known (``first_token_time``); NOT host
``publish``                 first token known -> engine thread hands the output to asyncio
``to_sse``                  handed over -> SSE chunk of the first token built (asyncio thread)
``sse_out``                 chunk built -> client has read it
``host_in``                 client sent -> scheduled (everything before the step)
``host_out``                first token known -> client has it
``ttft``                    client sent -> client has the first token
==========================  =====================================================================

``--step-python-ms`` simulates a GPU step's host-side preparation (pure Python before each
step, holding the GIL) to show how the asyncio thread then waits for the GIL.

The stamps come from wrappers this script puts around server functions (nothing is stamped
in a normal server). The step itself on CPU is far slower than on a GPU, so read the host
phases, not ``ttft``.

Usage::

    PYTHONPATH=$PWD python benchmarks/profile_request_path.py --requests 40
    PYTHONPATH=$PWD python benchmarks/profile_request_path.py --cprofile /tmp/rp.prof  # + cProfile

``--cprofile PATH`` profiles the engine thread and the asyncio thread (``PATH.0``, ``PATH.1``,
both merged in ``PATH``) and prints each one's top functions by own time; the phase times are
then inflated by the profiler.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any, Dict, List, Optional

PHASES = ["http_in", "asgi", "handler", "parse", "tokenize", "queue_put", "engine_pickup", "engine_add", "to_schedule",
          "step", "publish", "to_sse", "sse_out", "host_in", "host_out", "ttft"]


def gsm8k_5shot_prompt() -> str:
    """lm-eval's 5-shot GSM8K prompt: the first 5 train rows as shots, the first test question."""
    from mtpspec.data.gsm8k import bundled_gsm8k_dir, fewshot_prompt

    def rows(split: str, n: int) -> List[dict]:
        with open(os.path.join(bundled_gsm8k_dir(), f"{split}.jsonl"), encoding="utf-8") as f:
            return [json.loads(next(f)) for _ in range(n)]
    return fewshot_prompt(rows("train", 5), rows("test", 1)[0]["question"])


class Stamps:
    """``perf_counter`` stamps per request id (``cmpl-...-0``), filled from several threads."""

    def __init__(self) -> None:
        self.by_rid: Dict[str, Dict[str, float]] = {}
        self.seqs: Dict[str, Any] = {}
        self.current: Optional[str] = None  # the one request in flight (requests go one at a time)
        self.parse_start = self.parse_end = self.encode_s = 0.0  # of the request in flight

    def put(self, rid: Optional[str], name: str, t: Optional[float] = None) -> None:
        if rid is not None:
            self.by_rid.setdefault(rid, {}).setdefault(name, time.perf_counter() if t is None else t)


def instrument(engine: Any, stamps: Stamps) -> None:
    """Wrap the server's functions so each phase boundary leaves a stamp (first one wins)."""
    from mtpspec.entrypoints import openai_server as srv

    start = srv._start

    def _start(eng: Any, prompts: Any, params: Any, rid: str, arrival: float) -> Any:
        sub = f"{rid}-0"
        stamps.current = sub
        stamps.put(sub, "validated")
        stamps.put(sub, "asgi_start", _ASGI_START[0])
        stamps.put(sub, "parse_start", stamps.parse_start)
        stamps.put(sub, "parse_end", stamps.parse_end)
        stamps.put(sub, "encode_s", stamps.encode_s)
        out = start(eng, prompts, params, rid, arrival)
        stamps.put(sub, "queued")
        return out
    srv._start = _start

    parse = srv._parse

    async def _parse(request: Any, cls: Any) -> Any:
        stamps.parse_start = time.perf_counter()
        out = await parse(request, cls)
        stamps.parse_end = time.perf_counter()
        return out
    srv._parse = _parse

    tok = engine.tokenizer
    encode = tok.encode

    def timed_encode(text: str, *args) -> List[int]:
        t0 = time.perf_counter()
        ids = encode(text, *args)
        stamps.encode_s = time.perf_counter() - t0
        return ids
    tok.encode = timed_encode

    sse = srv._sse

    def _sse(obj: Any) -> str:
        s = sse(obj)
        if isinstance(obj, dict) and obj.get("choices"):
            stamps.put(f"{obj['id']}-0", "sse")
        return s
    srv._sse = _sse

    apply = engine._apply

    def _apply(cmd: tuple) -> None:
        if cmd[0] == "add":
            stamps.put(cmd[1], "engine_add_start")
            rid, sink = cmd[1], cmd[-1]

            def stamped_sink(item: Any) -> None:
                if getattr(item, "outputs", None) and item.outputs[0].token_ids:
                    stamps.put(rid, "published")  # handed to the asyncio loop
                sink(item)
            cmd = cmd[:-1] + (stamped_sink,)
        apply(cmd)
        if cmd[0] == "add":
            stamps.put(cmd[1], "engine_add_end")
    engine._apply = _apply

    find = engine._find_seq

    def _find_seq(rid: str) -> Any:
        seq = find(rid)
        stamps.seqs[rid] = seq
        return seq
    engine._find_seq = _find_seq


def _spin_before_steps(llm_engine: Any, seconds: float) -> None:
    """Make every ``llm_engine.step()`` first run pure Python for ``seconds`` (holds the GIL,
    releasing it only at the interpreter's switch interval), as a GPU step's input preparation."""
    step = llm_engine.step

    def spinning_step() -> Any:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
        return step()
    llm_engine.step = spinning_step


_ASGI_START = [0.0]  # when the ASGI app was last called (the request in flight)


def _stamped(app: Any) -> Any:
    """``app`` behind an ASGI wrapper that stamps each HTTP call into :data:`_ASGI_START`."""
    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            _ASGI_START[0] = time.perf_counter()
        await app(scope, receive, send)
    return asgi


def start_server(model: str, extra: List[str]) -> Any:
    """``mtpspec serve`` built in this process, uvicorn in a thread; returns ``(url, engine, server)``."""
    import uvicorn
    from mtpspec.entrypoints.serve import add_parser, build

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", model, "--device", "cpu", "--max-model-len", "2048", *extra])
    app, engine, _ = build(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(_stamped(app), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, name="uvicorn", daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    gc.collect()
    gc.freeze()  # as `mtpspec serve` does once the model is built
    return f"127.0.0.1:{port}", engine, server


class Client:
    """A bare HTTP/1.1 keep-alive client on one socket (as a benchmark's ``httpx.Client``, with
    no parsing cost between the bytes arriving and the stamp)."""

    def __init__(self, addr: str):
        host, port = addr.split(":")
        self.addr = addr
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def stream_once(self, body: bytes) -> Dict[str, float]:
        """One streamed completion; returns the stamps ``sent`` and ``first`` (first SSE chunk read)."""
        req = (f"POST /v1/completions HTTP/1.1\r\nHost: {self.addr}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        buf = b""
        first = None
        sent = time.perf_counter()
        self.sock.sendall(req)
        while not (b"data: [DONE]" in buf and buf.endswith(b"0\r\n\r\n")):
            data = self.sock.recv(65536)
            if not data:
                raise RuntimeError(f"connection closed: {buf[:500]!r}")
            buf += data
            if first is None and b"data: {" in buf and b"\n\n" in buf[buf.index(b"data: {"):]:
                first = time.perf_counter()
        if first is None:
            raise RuntimeError(f"no SSE chunk in the response: {buf[:500]!r}")
        return {"sent": sent, "first": first}

    def close(self) -> None:
        self.sock.close()


def phases(client: Dict[str, float], s: Dict[str, float], seq: Any) -> Dict[str, float]:
    """Milliseconds per phase of one request."""
    m = seq.metrics
    ms = lambda a, b: (b - a) * 1e3  # noqa: E731
    return {"http_in": ms(client["sent"], m.arrival_time), "asgi": ms(s["asgi_start"], m.arrival_time),
            "handler": ms(m.arrival_time, s["validated"]),
            "parse": ms(s["parse_start"], s["parse_end"]), "tokenize": s["encode_s"] * 1e3,
            "queue_put": ms(s["validated"], s["queued"]), "engine_pickup": ms(s["validated"], s["engine_add_start"]),
            "engine_add": ms(s["engine_add_start"], s["engine_add_end"]),
            "to_schedule": ms(s["engine_add_end"], m.first_scheduled_time),
            "step": ms(m.first_scheduled_time, m.first_token_time), "publish": ms(m.first_token_time, s["published"]),
            "to_sse": ms(s["published"], s["sse"]), "sse_out": ms(s["sse"], client["first"]),
            "host_in": ms(client["sent"], m.first_scheduled_time),
            "host_out": ms(m.first_token_time, client["first"]), "ttft": ms(client["sent"], client["first"])}


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import mtpspec
    from mtpspec.engine.detokenizer import load_tokenizer

    import torch
    torch.set_num_threads(args.torch_threads)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    model = args.model or mtpspec.demo_model_path(args.arch)
    prompt = gsm8k_5shot_prompt()
    n_tokens = len(load_tokenizer(model).encode(prompt))
    addr, engine, server = start_server(model, args.server_args.split() if args.server_args else [])
    stamps = Stamps()
    instrument(engine, stamps)
    if args.handoff_ms is not None:
        engine.first_output_handoff_s = args.handoff_ms / 1e3
    if args.step_python_ms > 0:
        _spin_before_steps(engine.engine, args.step_python_ms / 1e3)
    body = json.dumps({"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    prof = None
    rows: List[Dict[str, float]] = []
    conn = Client(addr)
    try:
        for i in range(args.warmup + args.requests):
            if i == args.warmup and args.cprofile:
                prof = _start_profile(engine, server)
            client = conn.stream_once(body)
            rid = stamps.current
            time.sleep(0.02)  # let the request finish and its stamps land
            if i >= args.warmup:
                rows.append(phases(client, stamps.by_rid[rid], stamps.seqs[rid]))
            time.sleep(args.gap_ms / 1e3)  # an idle engine between requests, as for a lone client
    finally:
        conn.close()
        if prof is not None:
            _stop_profile(prof, engine, server, args.cprofile)
        server.should_exit = True
        engine.shutdown()
    med = {p: statistics.median(r[p] for r in rows) for p in PHASES}
    return {"model": model, "prompt_tokens": n_tokens, "requests": len(rows), "median_ms": med,
            "p90_ms": {p: sorted(r[p] for r in rows)[int(0.9 * (len(rows) - 1))] for p in PHASES}}


def _start_profile(engine: Any, server: Any) -> List[Any]:
    """One ``cProfile.Profile`` enabled in each of the engine thread and the asyncio thread."""
    import cProfile
    profs = [cProfile.Profile(), cProfile.Profile()]
    done = threading.Event()
    engine._cmds.put(("call", lambda _: profs[0].enable(), lambda ok, v: done.set()))
    done.wait(10)
    loop = _server_loop(server)
    done2 = threading.Event()
    loop.call_soon_threadsafe(lambda: (profs[1].enable(), done2.set()))
    done2.wait(10)
    return profs


def _server_loop(server: Any) -> asyncio.AbstractEventLoop:
    for t in server.servers:
        return t.get_loop()
    raise RuntimeError("uvicorn has no server socket")


def _stop_profile(profs: List[Any], engine: Any, server: Any, path: str) -> None:
    import pstats
    done = threading.Event()
    engine._cmds.put(("call", lambda _: profs[0].disable(), lambda ok, v: done.set()))
    done.wait(10)
    done2 = threading.Event()
    _server_loop(server).call_soon_threadsafe(lambda: (profs[1].disable(), done2.set()))
    done2.wait(10)
    for i, prof in enumerate(profs):
        prof.dump_stats(f"{path}.{i}")
    st = pstats.Stats(f"{path}.0")
    st.add(f"{path}.1")
    st.dump_stats(path)
    for i, name in enumerate(("engine thread", "asyncio thread")):
        print(f"---- cProfile, {name}, by own time")
        pstats.Stats(f"{path}.{i}").sort_stats("tottime").print_stats(20)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled demo model of --arch)")
    p.add_argument("--arch", default="glm4_moe", help="bundled demo model (glm4_moe or glm_moe_dsa)")
    p.add_argument("--requests", type=int, default=30, help="measured requests (all prefix-cache hits)")
    p.add_argument("--warmup", type=int, default=3, help="requests before measuring (the first one fills the cache)")
    p.add_argument("--max-tokens", type=int, default=2, help="tokens per request")
    p.add_argument("--gap-ms", type=float, default=50.0, help="idle time between requests")
    p.add_argument("--server-args", default="", help="extra `mtpspec serve` flags")
    p.add_argument("--torch-threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="sys.setswitchinterval for the process (default: Python's 5 ms)")
    p.add_argument("--handoff-ms", type=float, default=None,
                   help="AsyncLLM.first_output_handoff_s in ms (default: the server's; 0: off)")
    p.add_argument("--step-python-ms", type=float, default=0.0,
                   help="SIMULATION: spin this long in Python (holding the GIL) before every engine step, as "
                        "a GPU step's host-side preparation does (default 0: off)")
    p.add_argument("--cprofile", default=None, help="write a cProfile of the measured requests here")
    p.add_argument("--json", default=None, help="also write the result as JSON here")
    args = p.parse_args(argv)
    res = run(args)
    print(f"{res['model']}: {res['prompt_tokens']}-token prompt, {res['requests']} streamed requests "
          "(prefix-cache hits), ms")
    print(f"{'phase':<14}{'median':>9}{'p90':>9}")
    for ph in PHASES:
        print(f"{ph:<14}{res['median_ms'][ph]:9.3f}{res['p90_ms'][ph]:9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

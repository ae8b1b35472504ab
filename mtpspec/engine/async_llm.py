"""``AsyncLLM``: the engine in its own thread, with an asyncio-facing ``generate`` per request.

One background thread owns the :class:`~mtpspec.engine.llm_engine.LLMEngine` (scheduler, block
manager, executor): it applies queued commands (add / abort / calls), runs ``step()`` while any
request is unfinished, and hands each step's progress to the asyncio loop of the caller in one
``call_soon_threadsafe``. Requests therefore join and leave the running batch between any two
steps (continuous batching); the engine itself is never touched from another thread.

Failure isolation:

* a request that fails validation raises in :meth:`AsyncLLM.generate` before it is queued;
* an error while queuing or publishing one request (the ``fault_injector`` test hook raises
  there) aborts that request only: its KV blocks are freed and its iterator raises
  :class:`RequestError`; the other requests go on;
* an error raised by ``engine.step()`` cannot be traced to one request: every request in the
  engine at that moment is aborted (blocks freed) and fails with :class:`RequestError`; new
  requests are still served. If the executor itself died (a rank is gone),
  :attr:`AsyncLLM.dead` is set and new requests raise :class:`EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Union

from mtpspec.engine.llm_engine import LLMEngine, PromptType, ValidatedPrompt
from mtpspec.engine.parallel_sampling import ParentRequest
from mtpspec.engine.sequence import Sequence
from mtpspec.outputs import CompletionOutput, RequestOutput
from mtpspec.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """More than ``max_queue_len`` requests are waiting to be scheduled."""


class EngineDeadError(RuntimeError):
    """The executor failed (a rank died); the engine cannot run steps any more."""


class RequestError(RuntimeError):
    """One request failed inside the engine loop (the message says why)."""


class ShuttingDownError(EngineDeadError):
    """The server is shutting down (Ctrl-C, SIGTERM): requests in flight end with this (a 503)."""


class EngineObserver:
    """Called in the engine thread (keep it quick); the default methods do nothing."""

    def on_step(self, engine: LLMEngine, finished: List[RequestOutput]) -> None:
        """After every step, with the requests that finished in it."""

    def on_abort(self, request_id: str, output: Optional[RequestOutput] = None) -> None:
        """A live request was aborted (client gone or cancelled); its blocks are free. ``output``:
        what it had produced (its ``metrics`` hold the TTFT and inter-token gaps of the tokens it
        got), ``None`` where the engine no longer knew the request."""

    def on_error(self, request_id: str) -> None:
        """A request failed inside the engine loop."""


@dataclass
class _Live:
    """Engine-thread bookkeeping of one request (``seq``: its sequence, or its
    :class:`ParentRequest` when it has several; ``sent``: its progress when last published;
    ``loop``: the event loop its outputs go to)."""

    request_id: str
    sink: Callable[[Any], None]
    loop: Optional[asyncio.AbstractEventLoop] = None
    seq: Union[None, Sequence, ParentRequest] = None
    sent: Any = 0
    scheduled: bool = False
    published: bool = False  # an output was handed to the loop


@dataclass
class EngineStats:
    """A snapshot taken by the engine thread after every loop iteration.

    Attributes:
        num_running, num_waiting: the scheduler's queues.
        num_free_blocks, num_total_blocks: KV blocks (per layer cache).
        num_pending: requests accepted by :meth:`AsyncLLM.generate` and not yet scheduled.
        num_steps: engine steps run so far.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_pending: int = 0
    num_steps: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)


class AsyncLLM:
    """Serve many concurrent requests from one :class:`~mtpspec.engine.llm.LLM`.

    Args:
        llm: a constructed ``LLM`` (tp 1 in-process or self-launched tp > 1 ranks; not
            ``torchrun``). ``AsyncLLM`` takes over its engine: do not call ``llm.generate``
            while the ``AsyncLLM`` runs.
        max_queue_len: most requests waiting to be scheduled (``None``: unbounded); one more
            raises :class:`QueueFullError` in :meth:`generate`.
        first_output_handoff_s: after a step that produced some request's first output (and
            at most :attr:`handoff_max_outputs` outputs in all), the engine thread waits up to
            this long (seconds; 0: never) for the event loop to run what those outputs woke (e.g.
            write the first SSE chunk) before it goes on. Otherwise the loop thread waits for the
            GIL while the engine thread prepares the next step in Python: the first token reaches
            the client that much later. Busier steps do not wait: the loop's work for many
            streams would hold the next step back. Default 0 (off): on an H200 serving a 13.7 B
            model, 2 ms changed neither the prefix-hit TTFT (15.32 vs 15.31 ms) nor the miss.

    Use :meth:`from_model` to build the ``LLM`` too.
    """

    #: most outputs a step may hand to the loops and still wait for them (``first_output_handoff_s``)
    handoff_max_outputs = 8

    def __init__(self, llm: Any, max_queue_len: Optional[int] = None, first_output_handoff_s: float = 0.0):
        if max_queue_len is not None and (not isinstance(max_queue_len, int) or max_queue_len < 1):
            raise ValueError(f"max_queue_len must be an int >= 1 or None, got {max_queue_len!r}")
        if getattr(llm, "_torchrun", False):
            raise ValueError("AsyncLLM does not run under torchrun; start the ranks with tensor_parallel_size")
        if not first_output_handoff_s >= 0:
            raise ValueError(f"first_output_handoff_s must be >= 0, got {first_output_handoff_s!r}")
        self.llm = llm
        self.engine: LLMEngine = llm.llm_engine
        self.max_queue_len = max_queue_len
        self.first_output_handoff_s = first_output_handoff_s
        self.observers: List[EngineObserver] = []
        # Test hook (server --debug-fault-marker): called in the engine thread for every published
        # output of a request; an exception fails that request only.
        self.fault_injector: Optional[Callable[[RequestOutput], None]] = None
        self.dead: Optional[str] = None
        self._cmds: "queue.Queue[tuple]" = queue.Queue()
        self._live: Dict[str, _Live] = {}
        self._pending = 0
        self._ids_in_use: set = set()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stats = EngineStats()
        self._stopping = False
        self._update_stats()
        self._thread = threading.Thread(target=self._run, name="mtpspec-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model: str, max_queue_len: Optional[int] = None, **llm_kwargs: Any) -> "AsyncLLM":
        """Build ``LLM(model, **llm_kwargs)`` and serve it."""
        from mtpspec.engine.llm import LLM
        return cls(LLM(model, **llm_kwargs), max_queue_len=max_queue_len)

    # ------------------------------------------------------------------ properties
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.scheduler_config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_logprobs(self) -> int:
        """The most logprobs a request may ask for per token (``--max-logprobs``; -1: no cap)."""
        return self.engine.max_logprobs

    @property
    def num_speculative_tokens(self) -> int:
        return self.engine.scheduler_config.num_speculative_tokens

    @property
    def default_sampling_fields(self) -> Dict[str, Any]:
        """Sampling fields the model's ``generation_config.json`` sets (``LLM.default_sampling_fields``):
        the defaults of requests that leave them unset."""
        return dict(getattr(self.llm, "default_sampling_fields", None) or {})

    def stats(self) -> EngineStats:
        """The latest :class:`EngineStats` (taken by the engine thread)."""
        s = self._stats
        with self._lock:
            s.num_pending = self._pending
        return s

    # ------------------------------------------------------------------ requests
    def validate(self, prompt: PromptType, params: SamplingParams) -> List[int]:
        """Check a request (see :meth:`LLMEngine.validate_request`); returns its prompt token ids.

        Raises:
            ValueError / TypeError: as ``validate_request``.
        """
        return self.engine.validate_request(prompt, params)[1]

    def validated_prompt(self, prompt: PromptType, params: SamplingParams,
                         add_special_tokens: bool = True) -> ValidatedPrompt:
        """Check a request once (:meth:`LLMEngine.validated_prompt`); passing the result to
        :meth:`add_request` with the same ``params`` neither tokenizes nor checks it again.

        Raises:
            ValueError / TypeError: as ``validate_request``.
        """
        return self.engine.validated_prompt(prompt, params, add_special_tokens)

    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: Optional[str] = None,
                    arrival_time: Optional[float] = None) -> "RequestStream":
        """Validate and queue one request now; iterate the returned stream for its progress.

        Must be called from a coroutine (it binds the stream to the running event loop).

        Args:
            prompt: text, ``{"prompt": text}``, ``{"prompt_token_ids": [...]}`` or a
                :class:`ValidatedPrompt` of :meth:`validated_prompt` (with these ``params``:
                not checked again).
            params: sampling parameters.
            request_id: unique id (default: a fresh one).
            arrival_time: ``time.perf_counter()`` when the request arrived (TTFT counts from it).

        Raises:
            ValueError / TypeError: the request is invalid (nothing was queued).
            QueueFullError: ``max_queue_len`` requests are already waiting.
            EngineDeadError: the executor failed earlier.
        """
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        # Tokenized and checked once, on the caller's thread: the engine thread does neither again.
        prompt = self.engine.validated_prompt(prompt, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if rid in self._ids_in_use:
                raise ValueError(f"request id {rid!r} is already in use")
            if self.max_queue_len is not None and self._pending >= self.max_queue_len:
                raise QueueFullError(f"the server queue is full ({self._pending} requests waiting, "
                                     f"max_queue_len={self.max_queue_len}); retry later")
            self._pending += 1
            self._ids_in_use.add(rid)
        def sink(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the caller's event loop is gone: nobody is listening
                self.abort(rid)
        self._cmds.put(("add", rid, prompt, params, arrival_time or time.perf_counter(), loop, sink))
        time.sleep(0)  # hand the GIL to the engine thread now (else it may wait a switch interval, 5 ms)
        return RequestStream(self, rid, q)

    def queue_room(self) -> Optional[int]:
        """How many more requests may wait now (``max_queue_len`` minus those waiting; ``None``:
        unbounded). A caller adding several requests checks it first, so that a batch that does not
        fit is refused whole rather than half-queued."""
        if self.max_queue_len is None:
            return None
        with self._lock:
            return self.max_queue_len - self._pending

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: Optional[str] = None,
                       arrival_time: Optional[float] = None) -> AsyncIterator[RequestOutput]:
        """:meth:`add_request` then iterate its :class:`RequestStream` (same arguments and errors).

        Yields cumulative :class:`RequestOutput` snapshots; the last one has ``finished=True``.
        With ``n > 1`` each snapshot holds the ``n`` completions so far (one that finished already
        carries its ``finish_reason``); with ``best_of > n`` only the final output is yielded.
        Leaving the iteration early aborts the request (every completion) and frees its KV blocks.
        """
        stream = self.add_request(prompt, params, request_id, arrival_time)
        async for out in stream:
            yield out

    def _release_id(self, request_id: str) -> None:
        with self._lock:
            self._ids_in_use.discard(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (from any thread); its KV blocks are freed before the next step."""
        self._cmds.put(("abort", request_id))

    def fail_all(self, reason: str) -> None:
        """End every request in flight with :class:`ShuttingDownError` (``reason``; from any thread,
        e.g. a signal handler): their streams get an error event at once instead of being cut when a
        graceful shutdown's wait runs out. Requests added later run as usual."""
        self._cmds.put(("fail_all", reason))

    async def call_in_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread between two steps; returns its result."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        fut = asyncio.get_running_loop().create_future()
        loop = fut.get_loop()

        def done(ok: bool, value: Any) -> None:
            if fut.cancelled():
                return
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

        self._cmds.put(("call", fn, lambda ok, v: loop.call_soon_threadsafe(done, ok, v)))
        return await fut

    def shutdown(self) -> None:
        """Stop the engine thread (pending requests fail) and the ranks (idempotent)."""
        if not self._stopping:
            self._stopping = True
            self._cmds.put(("stop",))
            self._thread.join(timeout=30)
            self.llm.shutdown()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        runner = getattr(self.engine.executor, "runner", None)  # in-process ranks (tp 1)
        device = getattr(runner, "device", None)
        if device is not None and device.type == "cuda":
            import torch
            torch.cuda.set_device(device)  # the current device is per thread
        while True:
            try:
                if not self._iterate():
                    return
            except Exception:  # never let the engine thread die: fail what is in flight, go on
                logger.exception("engine loop error; failing the requests in flight")
                self._fail_all(RequestError("internal engine loop error"))

    def _iterate(self) -> bool:
        """One loop iteration: commands, then a step if there is work. False on ``stop``."""
        eng = self.engine
        block = not eng.has_unfinished_requests()
        cmds = [self._cmds.get()] if block else []
        while True:
            try:
                cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                break
        for cmd in cmds:
            if cmd[0] == "stop":
                self._fail_all(RequestError("the engine is shutting down"))
                return False
            self._apply(cmd)
        if eng.has_unfinished_requests() and self.dead is None:
            self._step()
        self._update_stats()
        return True

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, arrival, loop, sink = cmd
            live = _Live(rid, sink, loop)
            if self.dead is not None:
                self._unpend(live)
                sink(EngineDeadError(self.dead))
                return
            try:
                self.engine.add_request(prompt, params, request_id=rid, arrival_time=arrival)
                live.seq = self._find_seq(rid)
                if live.seq is not None:  # nothing to publish before it moves (a ParentRequest's is a tuple)
                    live.sent = _progress(live.seq)
                self._live[rid] = live
            except Exception as exc:  # fails this request only
                self._unpend(live)
                self.engine.abort_request(rid)
                sink(exc if isinstance(exc, (ValueError, TypeError)) else RequestError(f"{type(exc).__name__}: {exc}"))
        elif kind == "abort":
            live = self._live.pop(cmd[1], None)
            if live is not None:
                self._unpend(live)
                self._notify("on_abort", cmd[1], self.engine.abort_request(cmd[1]))
        elif kind == "fail_all":
            self._fail_all(ShuttingDownError(cmd[1]))
        elif kind == "call":
            _, fn, reply = cmd
            try:
                reply(True, fn(self.engine))
            except Exception as exc:
                reply(False, exc)

    def _find_seq(self, rid: str) -> Union[Sequence, ParentRequest]:
        parent = self.engine.get_parent(rid)
        if parent is not None:
            return parent
        for s in reversed(self.engine.scheduler.waiting):
            if s.request_id == rid:
                return s
        raise RuntimeError(f"request {rid!r} was added but is not in the waiting queue")

    def _unpend(self, live: _Live) -> None:
        if not live.scheduled:
            live.scheduled = True
            with self._lock:
                self._pending -= 1

    def check_ranks(self) -> Optional[str]:
        """:attr:`dead`, set first if a rank process has exited meanwhile (``/health`` and the server's
        watcher call this, so a rank that dies while the engine is idle is noticed before the next
        request fails on it)."""
        if self.dead is None:
            gone = self.engine.executor.dead_ranks()
            if gone:
                self.dead = f"the engine's executor failed: {gone}"
        return self.dead

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception as exc:
            tb = traceback.format_exc()
            logger.error("engine step failed; aborting the %d requests in flight:\n%s", len(self._live), tb)
            from mtpspec.engine.executor import WorkerError
            # one line for clients; the traceback is in the log above
            why = exc.summary if isinstance(exc, WorkerError) else f"{type(exc).__name__}: {exc}".splitlines()[0]
            if isinstance(exc, WorkerError):
                self.dead = f"the engine's executor failed: {why}"
            self._fail_all(RequestError(f"engine step failed: {why}"))
            return
        done = {o.request_id: o for o in finished}
        batch = []
        first_progress: set = set()  # loops receiving some request's first output (not its last)
        first_last: set = set()  # loops receiving some request's first output that is its last
        for rid, live in list(self._live.items()):
            out = done.get(rid)
            try:
                if live.seq is not None and _is_scheduled(live.seq):
                    self._unpend(live)
                if out is None:
                    seq = live.seq
                    progress = None if seq is None else _progress(seq)
                    if seq is None or progress == live.sent:
                        continue
                    live.sent = progress
                    out = _snapshot(seq)
                    if out is None:  # best_of > n: only the final output is published
                        continue
                if self.fault_injector is not None:
                    self.fault_injector(out)
                batch.append((live.sink, out))
                if not live.published:
                    live.published = True
                    (first_last if out.finished else first_progress).add(live.loop)
                if out.finished:
                    del self._live[rid]
            except Exception as exc:  # this request only
                logger.warning("request %s failed: %s", rid, exc)
                self._live.pop(rid, None)
                self._unpend(live)
                self.engine.abort_request(rid)
                batch.append((live.sink, RequestError(f"request {rid} failed: {type(exc).__name__}: {exc}")))
                self._notify("on_error", rid)
        # Progress first (the first token's latency), then counters and stats, then the last
        # outputs: a client that sees its last token and then scrapes /metrics or reads stats()
        # finds it counted and its sequence freed.
        last = [(sink, item) for sink, item in batch if not isinstance(item, RequestOutput) or item.finished]
        if len(batch) > self.handoff_max_outputs:
            first_progress.clear()
            first_last.clear()
        for sink, item in batch:
            if isinstance(item, RequestOutput) and not item.finished:
                sink(item)
        self._hand_off(first_progress)
        self._notify("on_step", self.engine, finished)
        self._update_stats()
        for sink, item in last:
            sink(item)
        self._hand_off(first_last)

    def _hand_off(self, loops: set) -> None:
        """Wait (at most ``first_output_handoff_s`` in all) until each of ``loops`` ran what the
        outputs just handed to it woke: a callback queued behind them that queues the set of an
        event runs after the tasks they woke. Waiting releases the GIL to the loop's thread.
        Returns at once when ``loops`` is empty."""
        if not loops or self.first_output_handoff_s <= 0:
            return
        deadline = time.perf_counter() + self.first_output_handoff_s
        while loops:
            loop = loops.pop()
            if loop is None:
                continue
            ran = threading.Event()
            try:
                loop.call_soon_threadsafe(loop.call_soon, ran.set)
            except RuntimeError:  # the loop is closed
                continue
            left = deadline - time.perf_counter()
            if left <= 0 or not ran.wait(left):
                loops.clear()
                return

    def _notify(self, method: str, *args: Any) -> None:
        for obs in self.observers:
            try:
                getattr(obs, method)(*args)
            except Exception:
                logger.exception("engine observer %s.%s failed", type(obs).__name__, method)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, live in list(self._live.items()):
            self._unpend(live)
            try:
                self.engine.abort_request(rid)
            except Exception:
                pass
            live.sink(exc)
            self._notify("on_error", rid)
        self._live.clear()

    def _update_stats(self) -> None:
        sch = self.engine.scheduler
        bm = sch.block_manager
        self._stats = EngineStats(num_running=len(sch.running), num_waiting=len(sch.waiting),
                                  num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks,
                                  num_steps=self.engine.metrics.num_steps)


def _is_scheduled(seq: Union[Sequence, ParentRequest]) -> bool:
    if isinstance(seq, ParentRequest):
        return seq.is_scheduled
    return seq.metrics.first_scheduled_time is not None


def _progress(seq: Union[Sequence, ParentRequest]) -> Any:
    return seq.progress if isinstance(seq, ParentRequest) else len(seq.output_token_ids)


def _snapshot(seq: Union[Sequence, ParentRequest]) -> Optional[RequestOutput]:
    """A cheap cumulative output of a running request (prompt ids shared, outputs copied); a
    request with ``best_of > n`` has none (only its final output is published)."""
    if isinstance(seq, ParentRequest):
        return seq.to_output() if seq.streams else None
    lps = None if seq.output_logprobs is None else list(seq.output_logprobs)
    comp = CompletionOutput(0, seq.output_text, list(seq.output_token_ids), None, None, lps, seq.cumulative_logprob)
    return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [comp], False, seq.metrics,
                         seq.prompt_logprobs)


class RequestStream:
    """The progress of one queued request (from :meth:`AsyncLLM.add_request`).

    ``async for out in stream`` yields cumulative :class:`RequestOutput` snapshots (outputs
    produced faster than they are consumed are coalesced); the last has ``finished=True``.
    Leaving the loop early, or :meth:`abort`, aborts the request and frees its KV blocks.

    Raises (during iteration):
        RequestError: the request failed inside the engine loop.
        EngineDeadError: the executor failed.
    """

    def __init__(self, engine: AsyncLLM, request_id: str, q: asyncio.Queue):
        self.engine = engine
        self.request_id = request_id
        self._q = q
        self.finished = False

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)
            self.engine._release_id(self.request_id)

    async def next_output(self) -> RequestOutput:
        """Wait for the request's next cumulative output (outputs that arrived meanwhile are
        coalesced into the newest one). Cancelling the wait loses nothing and does not abort.

        Raises:
            RuntimeError: the stream has finished already.
            RequestError / EngineDeadError: the request failed (the stream is then finished).
        """
        if self.finished:
            raise RuntimeError(f"request {self.request_id!r}: the stream has finished")
        item = await self._q.get()
        while not self._q.empty() and not isinstance(item, BaseException) and not item.finished:
            item = self._q.get_nowait()  # coalesce: only the newest snapshot matters
        if isinstance(item, BaseException):
            self.finished = True
            self.engine._release_id(self.request_id)
            raise item
        if item.finished:
            self.finished = True
            self.engine._release_id(self.request_id)
        return item

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                yield await self.next_output()
        finally:
            self.abort()

"""The OpenAI-compatible HTTP server (FastAPI) over an :class:`~mtpspec.engine.async_llm.AsyncLLM`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus), and vLLM's ``POST /tokenize`` / ``/detokenize`` and
``GET /version``.
Body fields: :mod:`mtpspec.entrypoints.openai_protocol`; chat prompts:
:mod:`mtpspec.entrypoints.chat_template`; metrics: :mod:`mtpspec.entrypoints.server_metrics`.

Errors are OpenAI-style objects ``{"error": {"message", "type", "param", "code"}}``:

* 404: an unknown ``model`` (vLLM's ``NotFoundError``: "The model `X` does not exist.");
* 400: body not JSON or not matching the schema, an empty, over-long or
  out-of-vocabulary prompt, prompt tokens + ``max_tokens`` above ``max_model_len`` (vLLM's
  "This model's maximum context length is N tokens. However, you requested M tokens (P in the
  messages, T in the completion). ..."; ``max_tokens`` null: up to the context, never an
  error), bad sampling values (``n`` / ``best_of`` with vLLM's messages, e.g. "best_of must be
  greater than or equal to n, got n=3 and best_of=2."), unsupported parameters (``suffix``),
  more prompts in one request than ``max_queue_len`` (they could never be queued together);
* 503: the queue is full (``max_queue_len`` requests waiting, or too few free places for all of a
  request's prompts: nothing of it is queued) or the engine died (one line; the server then exits
  with status 1, as vLLM's API server does, so a supervisor can restart it);
* 500: the request failed inside the engine loop (other requests are unaffected).

A client that disconnects has its requests aborted (KV blocks freed before the next step),
whether it streams or not. Streaming uses server-sent events (``data: {json}\\n\\n`` chunks,
then ``data: [DONE]``); one chunk per engine step that emitted tokens (a speculative step may
emit several). While stop strings are set, the last ``max(len(stop)) - 1`` characters are
held back until the request finishes, so streamed text never shows a stop string.
``n > 1``: ``n`` choices per prompt (``index`` = prompt position * n + i, as vLLM); a stream
sends each choice's news in its own chunk, its finish reason when that choice ends. ``best_of >
n`` is not streamed: with ``stream`` the complete response is sent as one event, then
``[DONE]`` (vLLM's behaviour). ``usage.completion_tokens`` counts the returned choices' tokens;
with ``serve --enable-prompt-tokens-details`` (vLLM's flag) ``usage.prompt_tokens_details.cached_tokens``
says how many prompt tokens the prefix cache served (present only when non-zero, as in vLLM).
``logprobs`` are the engine's (:class:`~mtpspec.outputs.Logprob`: scored from the very logits
each token was sampled or verified with, the raw model distribution), so they stream with the
tokens: each chunk carries its new tokens' entries. ``echo`` with ``logprobs`` asks the engine
for ``prompt_logprobs`` (the prefill's logits); ``max_tokens: 0`` with ``echo`` runs just that
prefill (its one sampled token is not returned).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple, Type, TypeVar, Union

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mtpspec.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError, RequestError, RequestStream
from mtpspec.engine.detokenizer import LONG_TEXT_CHARS
from mtpspec.engine.llm_engine import PromptType, ValidatedPrompt, exceeds_max_logprobs
from mtpspec.entrypoints.chat_template import check_continue_final, check_template_kwargs, render_chat
from mtpspec.entrypoints.openai_protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, OpenAIError, TokenizeRequest, bad_request,
    internal_error)
from mtpspec.entrypoints.server_metrics import ServerMetrics
from mtpspec.outputs import CompletionOutput, Logprob, RequestOutput
from mtpspec.sampling_params import SamplingParams

M = TypeVar("M", bound=BaseModel)
logger = logging.getLogger(__name__)
_POLL_S = 0.25  # how often a waiting handler checks whether its client is still there


class ServerContext:
    """What the handlers share.

    Args:
        engine: the running :class:`AsyncLLM`.
        served_model_name: the ``model`` name clients must send (or omit); a list: any of them
            (``--served-model-name a b``, as vLLM); a response names its request's (:func:`_model_name`).
        model_path: the checkpoint folder (reported by ``/v1/models``).
        info: engine configuration reported by ``/v1/models`` (``mtpspec`` key) and ``/metrics``.
        metrics: the Prometheus metrics (registered as an engine observer here).
        enable_prompt_tokens_details: ``usage.prompt_tokens_details.cached_tokens`` in responses
            (vLLM's ``--enable-prompt-tokens-details``; off by default, as there).
        api_key: when set, every ``/v1`` request must carry ``Authorization: Bearer <api_key>``
            (vLLM's ``--api-key``), and so must ``/reset_prefix_cache``; others get 401. ``/health``,
            ``/metrics``, ``/version``, ``/tokenize`` and ``/detokenize`` stay open, as in vLLM.
        cors: Starlette ``CORSMiddleware`` keywords (``allow_origins``, ``allow_credentials``,
            ``allow_methods``, ``allow_headers``); ``None``: vLLM's defaults, every origin, method and
            header, no credentials (``serve --allowed-origins`` ...).

    Raises:
        ValueError: no served model name, or an empty ``api_key``.
    """

    def __init__(self, engine: AsyncLLM, served_model_name: Union[str, Sequence[str]], model_path: str,
                 info: Dict[str, Any], metrics: ServerMetrics, enable_prompt_tokens_details: bool = False,
                 api_key: Optional[str] = None, cors: Optional[Dict[str, Any]] = None):
        if api_key is not None and not api_key:
            raise ValueError("--api-key must not be empty")
        self.engine = engine
        self.api_key = api_key
        self.cors = cors if cors is not None else {"allow_origins": ["*"], "allow_credentials": False,
                                                   "allow_methods": ["*"], "allow_headers": ["*"]}
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
        if not names or not all(isinstance(x, str) and x for x in names):
            raise ValueError(f"served model names must be non-empty strings, got {served_model_name!r}")
        self.served_model_names = names
        self.served_model_name = names[0]
        self.model_path = model_path
        self.info = info
        self.metrics = metrics
        self.created = int(time.time())
        engine.observers.append(metrics)


# ---------------------------------------------------------------------------- helpers
#: vLLM request fields that mtpspec does not serve and that change what is generated, each with the
#: test of a value that asks for them (their defaults pass): a 400 naming the field, not a silent
#: no-op (a new-user review, 2026-12-04, found ``min_p`` sampled without its filter). ``echo`` is
#: served by ``/v1/completions`` (a model field there), so this catches it in chat only.
UNSERVED_FIELDS: Dict[str, Callable[[Any], bool]] = {
    "min_p": lambda v: v not in (None, 0, 0.0),
    "use_beam_search": bool,
    "length_penalty": lambda v: v not in (None, 1, 1.0),
    "echo": bool,
    "chat_template": lambda v: v is not None,
    "allowed_token_ids": lambda v: v is not None,
    "bad_words": bool,
    "truncate_prompt_tokens": lambda v: v is not None,
    "guided_json": lambda v: v is not None,
    "guided_regex": lambda v: v is not None,
    "guided_choice": lambda v: v is not None,
    "guided_grammar": lambda v: v is not None,
    "structured_outputs": lambda v: v is not None,
    "logits_processors": bool,
    "return_tokens_as_token_ids": bool,  # logprob tokens as "token_id:N": a client parsing ids would break
    "structural_tag": lambda v: v is not None,
    "prompt_embeds": lambda v: v is not None,
    "priority": lambda v: v not in (None, 0),  # vLLM refuses it too without --scheduling-policy priority
    "cache_salt": lambda v: v is not None,  # a client relying on a salted (isolated) prefix cache must know
}


async def _parse(request: Request, cls: Type[M]) -> M:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # e.g. "[" x 100,000: the parser's recursion limit
        raise bad_request("the request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    if body.get("stream_options") is not None and not body.get("stream"):  # vLLM's check and message
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    if "tool_choice" in cls.model_fields and body.get("tool_choice") not in (None, "none") \
            and body.get("tools") is None:  # vLLM's check and message
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if (body.get("tools") and "tool_choice" in cls.model_fields  # chat: vLLM without tool calling enabled
            and body.get("tool_choice", "auto") != "none"):
        raise bad_request("tool calling is not supported by mtpspec serve (vLLM: \"auto\" tool choice requires "
                          "--enable-auto-tool-choice and --tool-call-parser to be set); send no `tools`, or "
                          "`tool_choice: \"none\"`", "tools")
    ignored = {k for k in body if k not in cls.model_fields}
    for name in sorted(ignored & set(UNSERVED_FIELDS)):  # vLLM serves them; ignoring would change the output
        if UNSERVED_FIELDS[name](body[name]):
            hint = " (a server-wide template: start the server with --chat-template)" if name == "chat_template" else ""
            raise bad_request(f"{name} is not supported by mtpspec serve (got {body[name]!r}); leave it out{hint}",
                              name)
    if ignored:  # as vLLM: unknown fields are ignored, with a warning
        logger.warning("The following fields were present in the request but ignored: %s", ignored)
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        err = errors[0]
        path, tag = _field_path(err.get("loc", ()))
        loc = ".".join(str(x) for x in path)
        if tag is not None:  # a union: one error per accepted type; name the field and the types
            tags = [t for e in errors if (pt := _field_path(e.get("loc", ())))[0] == path and (t := pt[1])]
            rest = len([e for e in errors if _field_path(e.get("loc", ()))[0] != path])
            more = f" (and {rest} more errors)" if rest else ""
            raise bad_request(f"invalid request body: {loc}: expected one of {', '.join(dict.fromkeys(tags))}, "
                              f"got {_json_type(_lookup(body, path))}{more}", loc or None) from None
        more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
        raise bad_request(f"invalid request body: {loc}: {err.get('msg')}{more}", loc or None) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _field_path(loc: Sequence[Any]) -> Tuple[Tuple[Any, ...], Optional[str]]:
    """A pydantic error location up to its first union-branch tag (``("prompt", "list[int]", 0)``
    -> ``(("prompt",), "list[int]")``); the tag is ``None`` outside unions."""
    for i, x in enumerate(loc):
        if isinstance(x, str) and ("[" in x or x in _TYPE_TAGS):
            return tuple(loc[:i]), x
    return tuple(loc), None


def _lookup(body: Any, path: Sequence[Any]) -> Any:
    for x in path:
        try:
            body = body[x]
        except (KeyError, IndexError, TypeError):
            return None
    return body


def _json_type(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(v), type(v).__name__)


def _model_name(ctx: ServerContext, req: Any) -> str:
    """The ``model`` a response names: the served name the request sent (checked by
    :func:`_check_model`), else the first served name (vLLM's ``_get_model_name``)."""
    return req.model or ctx.served_model_name


def _response_id(prefix: str, request: Request, req: Any) -> str:
    """A response's ``id`` as vLLM's: ``prefix-`` and the ``X-Request-Id`` header, else the body's
    ``request_id``, else a random hex id. The engine's request ids get a random suffix more
    (:func:`_start`), so two requests sending the same id do not collide."""
    return f"{prefix}-{request.headers.get('x-request-id') or getattr(req, 'request_id', None) or uuid.uuid4().hex}"


def _render_chat(tokenizer: Any, req: Any) -> Tuple[str, List[str]]:
    """:func:`render_chat` of a request's ``messages`` (with its ``add_generation_prompt``,
    ``continue_final_message`` and ``chat_template_kwargs``); a 400 naming
    ``chat_template_kwargs``, ``continue_final_message`` or ``messages`` for what it refuses."""
    try:
        check_template_kwargs(req.chat_template_kwargs)
    except ValueError as exc:
        raise bad_request(str(exc), "chat_template_kwargs") from None
    try:
        check_continue_final(req.add_generation_prompt, req.continue_final_message)
    except ValueError as exc:
        raise bad_request(str(exc), "continue_final_message") from None
    try:
        return render_chat(tokenizer, [m.as_dict() for m in req.messages], req.add_generation_prompt,
                           req.chat_template_kwargs, continue_final_message=req.continue_final_message,
                           tools=req.tools or None,  # tool_choice "none" (_parse): vLLM still renders them
                           documents=getattr(req, "documents", None))
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None


def _check_model(ctx: ServerContext, name: Optional[str]) -> None:
    """404 for a ``model`` the server does not serve; none (``null``, absent) or an empty one is the
    first served name, as vLLM's ``_is_model_supported`` takes it (``if not model_name: return True``)."""
    if name and name not in ctx.served_model_names:
        # vLLM's answer: 404 NotFoundError "The model `X` does not exist."
        names = ", ".join(f"`{n}`" for n in ctx.served_model_names)
        raise OpenAIError(404, f"The model `{name}` does not exist. This server serves {names}.",
                          "NotFoundError", "model")


def _check_ranges(req: Any, vocab_size: int) -> None:
    """vLLM's ranges: ``seed`` an int64; ``stop_token_ids`` ids of the vocabulary."""
    if req.seed is not None and not -2 ** 63 <= req.seed < 2 ** 63:
        raise bad_request(f"seed must be in [-2**63, 2**63 - 1] (an int64), got {req.seed}", "seed")
    bad = [t for t in req.stop_token_ids or () if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})", "stop_token_ids")


def _check_unsupported(req: Any) -> None:
    if getattr(req, "suffix", None):
        raise bad_request("suffix is not supported", "suffix")
    if isinstance(req, ChatCompletionRequest) and req.best_of is not None:
        raise bad_request("best_of is not supported in chat completions (a /v1/completions field)", "best_of")
    fmt = req.response_format
    if fmt is not None and fmt.get("type") != "text":
        raise bad_request(f"response_format {fmt.get('type')!r} is not supported (no guided decoding); "
                          "only {\"type\": \"text\"} is accepted", "response_format")


def _logit_bias(bias: Optional[Dict[str, float]]) -> Optional[Dict[int, float]]:
    """OpenAI's ``{"token id": bias}`` as vLLM reads it: integer keys, biases clamped to [-100, 100]."""
    if not bias:
        return None
    bad = []
    out: Dict[int, float] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = min(100.0, max(-100.0, value))
        except (ValueError, TypeError):
            bad.append(key)
            continue
        if math.isnan(value):  # would clamp to -100 unnoticed (+-inf clamp to +-100, as vLLM)
            raise bad_request(f"logit_bias values must be numbers, got NaN for token {key!r}", "logit_bias")
    if bad:
        raise bad_request(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}",
                          "logit_bias")
    return out


def _check_num_logprobs(n: Optional[int], what: str, param: str, vocab_size: int, max_logprobs: int) -> None:
    """vLLM's checks: ``N >= 0`` or ``-1`` (the whole vocabulary), at most ``max_logprobs``
    (``--max-logprobs``; -1: no cap)."""
    if n is None:
        return
    if n < 0 and n != -1:
        raise bad_request(f"`{param}` must be a positive value or -1.", param)
    if exceeds_max_logprobs(vocab_size if n == -1 else n, max_logprobs):
        raise bad_request(f"Requested {what} logprobs of {vocab_size if n == -1 else n}, which is greater than "
                          f"max allowed: {max_logprobs}", param)


def _sampling_params(req: Any, max_tokens: Optional[int], extra_stop: Sequence[str] = (),
                     logprobs: Optional[int] = None, prompt_logprobs: Optional[int] = None,
                     defaults: Optional[Dict[str, Any]] = None) -> SamplingParams:
    """The request's :class:`SamplingParams`; a field it leaves unset takes ``defaults`` (the model's
    generation_config.json, as vLLM's ``--generation-config auto``), else the OpenAI default. The
    default's ``max_tokens`` (the file's ``max_new_tokens``) also caps the request's, as vLLM's
    ``get_max_tokens`` does."""
    d = defaults or {}
    stop = req.stop
    stops = ([stop] if isinstance(stop, str) else list(stop or [])) + [s for s in extra_stop if s not in (stop or [])]
    pick = lambda value, name, fallback: d.get(name, fallback) if value is None else value  # noqa: E731
    try:
        return SamplingParams(
            n=1 if req.n is None else req.n, best_of=getattr(req, "best_of", None),
            temperature=pick(req.temperature, "temperature", 1.0),
            top_p=pick(req.top_p, "top_p", 1.0),
            top_k=pick(req.top_k, "top_k", 0),
            seed=req.seed, max_tokens=_capped(max_tokens, d.get("max_tokens")), stop=stops or None,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
            presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
            frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
            repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
            min_tokens=req.min_tokens, logit_bias=_logit_bias(req.logit_bias), logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, include_stop_str_in_output=req.include_stop_str_in_output)
    except (ValueError, TypeError) as exc:
        param = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), param if param.isidentifier() else None) from None


def _capped(max_tokens: Optional[int], cap: Optional[int]) -> Optional[int]:
    """``min(max_tokens, cap)`` where both are set, else whichever is."""
    return cap if max_tokens is None else max_tokens if cap is None else min(max_tokens, cap)


def _normalise_prompts(prompt: Any) -> List[Dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    if all(isinstance(p, str) for p in prompt):
        return [{"prompt": p} for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [{"prompt_token_ids": list(p)} for p in prompt]
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
                      "prompt")


def _validate_all(engine: AsyncLLM, prompts: List[Dict[str, Any]], params: SamplingParams,
                  field: str = "prompt", add_special_tokens: bool = True) -> List[ValidatedPrompt]:
    """Tokenize and check every prompt once (:meth:`AsyncLLM.validated_prompt`); the results go
    to :func:`_start` as they are, so nothing is tokenized or checked again.

    Raises:
        OpenAIError: 400 naming the first bad prompt (``prompt i:`` when there are several) and,
            as ``param``, ``field`` (``"messages"`` for a chat request's rendered prompt) unless the
            fault is in ``logit_bias`` or ``stop``.
    """
    out = []
    for i, p in enumerate(prompts):
        try:
            out.append(engine.validated_prompt(p, params, add_special_tokens))
        except (ValueError, TypeError) as exc:
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            msg = str(exc)
            param = "logit_bias" if "logit_bias" in msg else "stop" if "stop strings" in msg else field
            raise bad_request(where + msg, param) from None
    return out


async def _validated(engine: AsyncLLM, prompts: List[Dict[str, Any]], params: SamplingParams,
                     field: str = "prompt", add_special_tokens: bool = True) -> List[ValidatedPrompt]:
    """:func:`_validate_all` in a worker thread when the request's text prompts have
    ``LONG_TEXT_CHARS`` or more characters in all (a huge prompt, or many, must not stall the event
    loop, other requests' streams and ``/health``; a text that long is tokenized with the GIL
    released), else right here (a thread hop costs a short prompt more than its tokenization)."""
    if sum(len(p["prompt"]) for p in prompts if isinstance(p.get("prompt"), str)) >= LONG_TEXT_CHARS:
        return await asyncio.to_thread(_validate_all, engine, prompts, params, field, add_special_tokens)
    return _validate_all(engine, prompts, params, field, add_special_tokens)


def _check_context(engine: AsyncLLM, prompt_ids: List[List[int]], max_tokens: Optional[int], param: str) -> None:
    """400 when prompt + ``max_tokens`` exceeds ``max_model_len`` (vLLM's check and message).

    ``max_tokens=None`` means "until the context is full" and always fits.
    """
    if max_tokens is None:
        return
    limit = engine.max_model_len
    for i, ids in enumerate(prompt_ids):
        if len(ids) + max_tokens > limit:
            where = f"prompt {i}: " if len(prompt_ids) > 1 else ""
            raise bad_request(
                f"{where}This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.", param)


def _start(engine: AsyncLLM, prompts: Sequence[PromptType], params: SamplingParams, rid: str,
           arrival: float) -> List[RequestStream]:
    streams: List[RequestStream] = []
    cap, room = engine.max_queue_len, engine.queue_room()
    if cap is not None and len(prompts) > cap:  # can never fit: not a retryable 503
        raise bad_request(f"the request has {len(prompts)} prompts, more than the server queues at once "
                          f"(max_queue_len={cap}); send at most {cap} prompts per request", "prompt")
    if room is not None and len(prompts) > room:  # refused whole, nothing queued or aborted
        raise OpenAIError(503, f"the server queue is full ({cap - room} requests waiting, max_queue_len={cap}; "
                          f"this request needs room for {len(prompts)}); retry later", "server_overloaded")
    rid = f"{rid}-{uuid.uuid4().hex[:8]}"  # unique, whatever request_id a client sent (_response_id)
    try:
        for i, p in enumerate(prompts):
            streams.append(engine.add_request(p, params, request_id=f"{rid}-{i}", arrival_time=arrival))
    except QueueFullError as exc:
        for s in streams:
            s.abort()
        raise OpenAIError(503, str(exc), "server_overloaded") from None
    except EngineDeadError as exc:
        for s in streams:
            s.abort()
        raise OpenAIError(503, str(exc), "server_error") from None
    except (ValueError, TypeError) as exc:
        for s in streams:
            s.abort()
        raise bad_request(str(exc), "prompt") from None
    return streams


async def _drain(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    assert last is not None and last.finished
    return last


async def _collect(streams: List[RequestStream], request: Request) -> Optional[List[RequestOutput]]:
    """Run every stream to completion; ``None`` when the client went away (all aborted)."""
    tasks = [asyncio.ensure_future(_drain(s)) for s in streams]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=_POLL_S, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
            if not pending:
                return [t.result() for t in tasks]
            if await request.is_disconnected():
                return None
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


def _engine_error(exc: BaseException) -> OpenAIError:
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc), "server_error")
    return OpenAIError(500, str(exc), "server_error")


def _token_str(engine: AsyncLLM, tid: int) -> str:
    tok = engine.tokenizer
    return tok.decode([tid], skip_special_tokens=False) if tok is not None else f"token_id:{tid}"


def _prompt_text(engine: AsyncLLM, out: RequestOutput) -> str:
    if out.prompt is not None:
        return out.prompt
    return engine.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False) if engine.tokenizer else ""


def _lp(v: float) -> float:
    return max(v, -9999.0)  # as vLLM: -inf is not JSON


def _entry_text(engine: AsyncLLM, tid: int, lp: Optional[Logprob]) -> str:
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else _token_str(engine, tid)


def _top(entries: Dict[int, Logprob], num: int) -> List[Tuple[int, Logprob]]:
    """The ``num`` likeliest entries of a ``{id: Logprob}`` (ranks 1 .. num; ``-1``: all of them, the
    whole vocabulary under ``--max-logprobs -1``), most likely first."""
    if num == -1:
        num = len(entries)
    return sorted(((t, v) for t, v in entries.items() if v.rank is not None and v.rank <= num),
                  key=lambda x: (x[1].rank, -x[1].logprob))[:num]


def _completion_logprobs(engine: AsyncLLM, ids: Sequence[int], entries: Sequence[Optional[Dict[int, Logprob]]],
                         num: int, offset0: int) -> Dict[str, Any]:
    """OpenAI legacy ``logprobs`` for ``ids`` (``entries[i]`` scores ``ids[i]``; ``None`` for an echoed
    prompt's first token): ``top_logprobs[i]`` holds the ``num`` likeliest tokens plus the chosen
    one when it is not among them (vLLM's convention, so ``logprobs: 0`` gives just the chosen
    token); ``text_offset`` counts from ``offset0``."""
    tokens, token_lps, tops, offsets = [], [], [], []
    off = offset0
    for tid, d in zip(ids, entries):
        chosen = None if d is None else d[tid]
        s = _entry_text(engine, tid, chosen)
        tokens.append(s)
        token_lps.append(None if chosen is None else _lp(chosen.logprob))
        top: Optional[Dict[str, float]] = None
        if d is not None:
            top = {}
            for t, v in _top(d, num):
                top.setdefault(_entry_text(engine, t, v), _lp(v.logprob))  # ids that decode alike: the likelier
            top.setdefault(s, _lp(chosen.logprob))  # as vLLM: the chosen token is always listed (N or N + 1)
        tops.append(top)
        offsets.append(off)
        off += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(engine: AsyncLLM, ids: Sequence[int], entries: Sequence[Dict[int, Logprob]],
                   num: int) -> Dict[str, Any]:
    """OpenAI chat ``logprobs.content`` for ``ids``: each token with its ``num`` likeliest alternatives."""
    content = []
    for tid, d in zip(ids, entries):
        s = _entry_text(engine, tid, d[tid])
        tops = [{"token": (ts := _entry_text(engine, t, v)), "logprob": _lp(v.logprob), "bytes": list(ts.encode("utf-8"))}
                for t, v in _top(d, num)]
        content.append({"token": s, "logprob": _lp(d[tid].logprob), "bytes": list(s.encode("utf-8")),
                        "top_logprobs": tops})
    return {"content": content}


def _prompt_logprobs_json(entries: Optional[Sequence[Optional[Dict[int, Logprob]]]]) -> Optional[List[Any]]:
    """vLLM's ``prompt_logprobs`` field: per prompt token ``None`` or ``{id: {logprob, rank, decoded_token}}``."""
    if entries is None:
        return None
    return [None if d is None else {str(t): {"logprob": _lp(v.logprob), "rank": v.rank, "decoded_token": v.decoded_token}
                                    for t, v in d.items()} for d in entries]


def _final_usage(req: Any) -> bool:
    """``stream_options.include_usage`` (vLLM's default: true once ``stream_options`` is given)."""
    opts = req.stream_options
    return opts is not None and bool(opts.include_usage)


def _continuous_usage(req: Any) -> bool:
    """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): usage in every chunk."""
    return _final_usage(req) and bool(req.stream_options.continuous_usage_stats)


def _usage_so_far(prompt_tokens: int, completion_tokens: int) -> Dict[str, Any]:
    """A streamed chunk's usage (continuous usage stats, vLLM's): its prompt's tokens and the tokens of
    the chunk's choice so far."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _usage(outs: Sequence[RequestOutput], prompt_tokens_details: bool = False) -> Dict[str, Any]:
    """Prompt tokens once per prompt; completion tokens of every returned choice (vLLM's count:
    with ``best_of > n`` the candidates not returned are not counted).

    ``prompt_tokens_details`` (the server's ``--enable-prompt-tokens-details``): adds vLLM's
    ``"prompt_tokens_details": {"cached_tokens": N}``, the prompt tokens the prefix cache served
    (:attr:`RequestOutput.num_cached_tokens`), only when N > 0, as vLLM does. Several prompts in
    one completion request: the sum over them (vLLM reports the last prompt's).
    """
    p = sum(len(o.prompt_token_ids) for o in outs)
    c = sum(len(x.token_ids) for o in outs for x in o.outputs)
    usage: Dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if prompt_tokens_details:
        cached = sum(o.num_cached_tokens or 0 for o in outs)
        if cached:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


class _Delta:
    """Per-choice streaming state: what was sent already, with stop-string hold-back.

    ``logprob_offset``: ``text_offset`` of the next token's logprob entry (completions);
    ``done``: the choice's finish reason was sent.
    """

    def __init__(self, holdback: int):
        self.holdback = holdback
        self.text_sent = 0
        self.tokens_sent = 0
        self.logprob_offset = 0
        self.done = False

    def next(self, c: CompletionOutput) -> Tuple[str, List[int], List[Dict[int, Logprob]]]:
        """New text, token ids and (with ``logprobs``) their entries of choice ``c`` since the last
        call (all its held-back text once it finished)."""
        visible = c.text if c.finished() else c.text[:max(0, len(c.text) - self.holdback)]
        text = visible[self.text_sent:] if len(visible) > self.text_sent else ""
        self.text_sent = max(self.text_sent, len(visible))
        ids = c.token_ids[self.tokens_sent:]
        lps = (c.logprobs or [])[self.tokens_sent:len(c.token_ids)]
        self.tokens_sent = len(c.token_ids)
        return text, ids, lps


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _merged(streams: List[RequestStream], request: Request) -> AsyncIterator[Tuple[int, Any]]:
    """``(choice index, RequestOutput)`` from all streams as they come; stops quietly when the
    client disconnects; raises the first stream error. Every stream is aborted on exit.

    One stream (the common case) is read directly; several are pumped into one queue.
    """
    if len(streams) == 1:
        async for item in _single(streams[0], request):
            yield item
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            q.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            try:
                async with asyncio.timeout(_POLL_S):
                    i, item = await q.get()
            except TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                remaining -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def _single(stream: RequestStream, request: Request) -> AsyncIterator[Tuple[int, Any]]:
    """:func:`_merged` of one stream: its outputs awaited in this task (no pump task and queue
    between the engine's hand-off and the SSE chunk: one event-loop pass instead of several)."""
    try:
        while not stream.finished:
            try:
                async with asyncio.timeout(_POLL_S):
                    out = await stream.next_output()
            except TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            yield 0, out
    finally:
        stream.abort()


def _stream_error_events(exc: BaseException) -> str:
    err = exc if isinstance(exc, OpenAIError) else _engine_error(exc)
    return _sse(err.body()) + "data: [DONE]\n\n"


class _InternalErrors:
    """ASGI middleware: an unexpected exception in a handler becomes a JSON 500 (logged with its
    traceback) on a connection that stays open. Starlette's own handler for ``Exception`` answers too,
    but then re-raises, and the server closes the connection: a client's next request on it got
    "connection reset" (a new-user pass: a chat template raising; a body nested 100,000 deep). An
    exception after the response started (a stream) is re-raised: nothing else can be sent."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, tracked)
        except ClientDisconnect:
            return  # the client went away while sending its body: no one to answer
        except Exception as exc:
            if started:
                raise
            logger.exception("internal error in %s %s", scope.get("method"), scope.get("path"))
            body = internal_error(exc).body()
            await JSONResponse(body, status_code=500)(scope, receive, send)


class _RequireApiKey:
    """ASGI middleware of ``--api-key``: an HTTP request whose path starts with ``/v1`` (vLLM guards
    the same paths), or ``/reset_prefix_cache`` (it changes the server's state; vLLM serves it in dev
    mode only), must carry ``Authorization: Bearer <key>`` (compared in constant time), else 401 with an
    OpenAI-style error body; ``OPTIONS`` requests pass, for CORS pre-flights."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and (
                path.startswith("/v1") or path == "/reset_prefix_cache"):
            # the first Authorization header, as Starlette's request.headers reads it
            got = next((v for k, v in scope.get("headers") or [] if k == b"authorization"), b"")
            if not hmac.compare_digest(got, self.expected):
                err = OpenAIError(401, "Unauthorized: a valid API key is needed (header 'Authorization: Bearer "
                                       "<key>', the server's --api-key)", "authentication_error")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------------- app
def build_app(ctx: ServerContext) -> FastAPI:
    """The FastAPI application over ``ctx`` (run it with uvicorn)."""
    app = FastAPI(title="mtpspec OpenAI-compatible server")
    app.state.ctx = ctx
    engine = ctx.engine

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """404 / 405 (and other routing errors) as OpenAI-style error objects."""
        msg = f"{exc.detail}: {request.method} {request.url.path}"
        return JSONResponse(OpenAIError(exc.status_code, msg, "invalid_request_error").body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    app.add_middleware(_InternalErrors)  # any other exception: a JSON 500 (see the class)
    if ctx.api_key is not None:
        app.add_middleware(_RequireApiKey, api_key=ctx.api_key)  # outside _InternalErrors: checked first
    # outermost: answers CORS pre-flights, and a browser sees every response (a 401 too), as vLLM's
    app.add_middleware(CORSMiddleware, **ctx.cors)

    @app.get("/health")
    async def health() -> Response:
        dead = engine.check_ranks()
        if dead is not None:
            return JSONResponse(OpenAIError(503, dead, "server_error").body(), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> Dict[str, Any]:
        from mtpspec import __version__
        return {"version": __version__}  # vLLM's GET /version

    @app.get("/v1/models")
    async def models() -> Dict[str, Any]:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": ctx.created, "owned_by": "mtpspec",
            "root": ctx.model_path, "max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
            "mtpspec": ctx.info} for name in ctx.served_model_names]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(ctx.metrics.render(engine.stats()), media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Dict[str, Any]:
        """vLLM's endpoint: forget every cached KV block no running request holds."""
        n = await engine.call_in_engine(lambda eng: eng.reset_prefix_cache())
        return {"status": "ok", "num_blocks_reset": n}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Dict[str, Any]:
        req = await _parse(request, TokenizeRequest)
        _check_model(ctx, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'")
        if engine.tokenizer is None:
            raise bad_request("this model has no tokenizer")
        text = req.prompt if req.prompt is not None else \
            _render_chat(engine.tokenizer, req)[0]
        special = req.add_special_tokens if req.add_special_tokens is not None else req.prompt is not None
        ids = await asyncio.to_thread(engine.tokenizer.encode, text, special) if len(text) >= LONG_TEXT_CHARS else \
            engine.tokenizer.encode(text, special)
        out: Dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}
        if req.return_token_strs:  # vLLM's: each id's token string (the vocabulary's, not decoded text)
            out["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Dict[str, Any]:
        req = await _parse(request, DetokenizeRequest)
        _check_model(ctx, req.model)
        if engine.tokenizer is None:
            raise bad_request("this model has no tokenizer")
        if any(not 0 <= t < engine.vocab_size for t in req.tokens):
            raise bad_request(f"token ids must be in [0, {engine.vocab_size})", "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req = await _parse(request, CompletionRequest)
        _check_model(ctx, req.model)
        _check_unsupported(req)
        _check_ranges(req, engine.vocab_size)
        _check_num_logprobs(req.logprobs, "sample", "logprobs", engine.vocab_size, engine.max_logprobs)
        _check_num_logprobs(req.prompt_logprobs, "prompt", "prompt_logprobs", engine.vocab_size, engine.max_logprobs)
        _check_stream_prompt_logprobs(req)
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens=0 is only allowed with echo=true (prompt scoring)", "max_tokens")
        if req.max_tokens == 0 and req.min_tokens > 0:
            raise bad_request(f"min_tokens must be less than or equal to max_tokens=0, got {req.min_tokens}.",
                              "min_tokens")
        score_only = req.max_tokens == 0
        prompt_lp = req.prompt_logprobs
        if prompt_lp is None and req.echo and req.logprobs is not None:
            prompt_lp = req.logprobs  # as vLLM: echo + logprobs scores the prompt too
        prompts = _normalise_prompts(req.prompt)
        params = _sampling_params(req, 1 if score_only else req.max_tokens,
                                  logprobs=None if score_only else req.logprobs, prompt_logprobs=prompt_lp,
                                  defaults=getattr(engine, "default_sampling_fields", None))
        validated = await _validated(engine, prompts, params, add_special_tokens=req.add_special_tokens)
        prompt_ids = [v.token_ids for v in validated]
        rid = _response_id("cmpl", request, req)
        if score_only and prompt_lp is None:
            return _maybe_one_event(req, _echo_only(ctx, req, prompts, prompt_ids, rid, params.n))
        if not score_only:
            _check_context(engine, prompt_ids, req.max_tokens, "max_tokens")
        streams = _start(engine, validated, params, rid, arrival)
        if req.stream and params.num_sequences == params.n:
            return StreamingResponse(_completion_sse(ctx, req, streams, params, rid, request),
                                     media_type="text/event-stream")
        try:
            outs = await _collect(streams, request)
        except (RequestError, EngineDeadError) as exc:
            raise _engine_error(exc) from None
        if outs is None:
            return Response(status_code=499)
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                gen_ids, gen_lps = ([], []) if score_only else (list(c.token_ids), list(c.logprobs or []))
                prefix = _prompt_text(engine, out) if req.echo else ""
                choice: Dict[str, Any] = {"index": i * params.n + c.index,
                                          "text": prefix + ("" if score_only else c.text), "logprobs": None,
                                          "finish_reason": "length" if score_only else c.finish_reason,
                                          "stop_reason": None if score_only else c.stop_reason}
                if req.logprobs is not None:
                    ids = (list(out.prompt_token_ids) if req.echo else []) + gen_ids
                    entries = (list(out.prompt_logprobs) if req.echo else []) + gen_lps
                    choice["logprobs"] = _completion_logprobs(engine, ids, entries, req.logprobs, 0)
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs_json(out.prompt_logprobs)
                if req.return_token_ids:
                    choice["token_ids"] = gen_ids
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                choices.append(choice)
        usage = _usage(outs, ctx.enable_prompt_tokens_details)
        if score_only:
            usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
        return _maybe_one_event(req, {"id": rid, "object": "text_completion", "created": int(time.time()),
                                      "model": _model_name(ctx, req), "choices": choices, "usage": usage})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        arrival = time.perf_counter()
        req = await _parse(request, ChatCompletionRequest)
        _check_model(ctx, req.model)
        _check_unsupported(req)
        _check_ranges(req, engine.vocab_size)
        if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
            raise bad_request(f"max_completion_tokens must be an int >= 1 or null, got {req.max_completion_tokens}",
                              "max_completion_tokens")
        if req.top_logprobs is not None:
            if req.top_logprobs < 0 and req.top_logprobs != -1:
                raise bad_request("`top_logprobs` must be a positive value or -1.", "top_logprobs")
            if (req.top_logprobs == -1 or req.top_logprobs > 0) and not req.logprobs:
                raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        num_lp = (req.top_logprobs or 0) if req.logprobs else None
        _check_num_logprobs(num_lp, "sample", "top_logprobs", engine.vocab_size, engine.max_logprobs)
        _check_num_logprobs(req.prompt_logprobs, "prompt", "prompt_logprobs", engine.vocab_size, engine.max_logprobs)
        _check_stream_prompt_logprobs(req)
        if engine.tokenizer is None:
            raise bad_request("chat completions need a tokenizer; this model has none")
        text, stops = _render_chat(engine.tokenizer, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = _sampling_params(req, max_tokens, stops, logprobs=num_lp, prompt_logprobs=req.prompt_logprobs,
                                  defaults=getattr(engine, "default_sampling_fields", None))
        validated = await _validated(engine, [{"prompt": text}], params, "messages", req.add_special_tokens)
        _check_context(engine, [validated[0].token_ids], max_tokens,
                       "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
        rid = _response_id("chatcmpl", request, req)
        streams = _start(engine, validated, params, rid, arrival)
        if req.stream:
            return StreamingResponse(_chat_sse(ctx, req, streams, params, rid, request,
                                               len(validated[0].token_ids)), media_type="text/event-stream")
        try:
            outs = await _collect(streams, request)
        except (RequestError, EngineDeadError) as exc:
            raise _engine_error(exc) from None
        if outs is None:
            return Response(status_code=499)
        out = outs[0]
        choices = []
        for c in out.outputs:
            choice: Dict[str, Any] = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                                      "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.logprobs:
                choice["logprobs"] = _chat_logprobs(engine, c.token_ids, c.logprobs, num_lp)
            if req.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
            choices.append(choice)
        body = {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": _model_name(ctx, req), "choices": choices,
                "usage": _usage(outs, ctx.enable_prompt_tokens_details)}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = _prompt_logprobs_json(out.prompt_logprobs)  # vLLM: on the response
        return JSONResponse(body)

    return app


def _check_stream_prompt_logprobs(req: Any) -> None:
    n = req.prompt_logprobs
    if n is not None and req.stream and (n > 0 or n == -1):
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")


def _maybe_one_event(req: CompletionRequest, body: Dict[str, Any]) -> Response:
    """The response as JSON, or, when ``stream`` was asked for a request that is not streamed
    (``best_of > n``, as vLLM: "Similar to the OpenAI API, when n != best_of, we do not stream";
    ``max_tokens: 0`` + ``echo``: nothing to stream), as one server-sent event holding the whole
    response, then ``[DONE]``."""
    if not req.stream:
        return JSONResponse(body)

    async def one_event() -> AsyncIterator[str]:
        yield _sse(body)
        yield "data: [DONE]\n\n"
    return StreamingResponse(one_event(), media_type="text/event-stream")


def _echo_only(ctx: ServerContext, req: CompletionRequest, prompts: List[Dict[str, Any]],
               prompt_ids: List[List[int]], rid: str, n: int) -> Dict[str, Any]:
    """``max_tokens: 0`` + ``echo`` without log-probabilities: the prompts back (``n`` choices
    each), no engine work."""
    engine = ctx.engine
    choices = []
    for i, (p, ids) in enumerate(zip(prompts, prompt_ids)):
        text = p.get("prompt")
        if text is None:
            text = engine.tokenizer.decode(ids, skip_special_tokens=False) if engine.tokenizer else ""
        for j in range(n):
            choice: Dict[str, Any] = {"index": i * n + j, "text": text, "logprobs": None, "finish_reason": "length",
                                      "stop_reason": None}
            if req.return_token_ids:
                choice["token_ids"] = []
                choice["prompt_token_ids"] = list(ids)
            choices.append(choice)
    n = sum(len(x) for x in prompt_ids)
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": _model_name(ctx, req),
            "choices": choices, "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}}


def _holdback(params: SamplingParams) -> int:
    stops = params.stop_strings
    if params.include_stop_str_in_output:
        return 0  # the stop string is part of the text; only text after it is cut, never sent yet
    return max(len(s) for s in stops) - 1 if stops else 0


async def _completion_sse(ctx: ServerContext, req: CompletionRequest, streams: List[RequestStream],
                          params: SamplingParams, rid: str, request: Request) -> AsyncIterator[str]:
    """One chunk per choice that has news (``index`` = prompt position * n + completion index)."""
    engine = ctx.engine
    created = int(time.time())
    n = params.n
    deltas = [_Delta(_holdback(params)) for _ in range(len(streams) * n)]
    finals: List[Optional[RequestOutput]] = [None] * len(streams)
    echoed = [not req.echo] * (len(streams) * n)
    continuous = _continuous_usage(req)

    def chunk(choices: List[Dict[str, Any]], usage: Optional[Dict[str, Any]] = None) -> str:
        body: Dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                "model": _model_name(ctx, req), "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return _sse(body)

    score_only = req.max_tokens == 0  # echo of the prompt (and its logprobs) only
    merged = _merged(streams, request)
    try:
        async for i, out in merged:
            if out.finished:
                finals[i] = out
            for c in out.outputs:
                j = i * n + c.index
                d = deltas[j]
                if d.done:
                    continue
                if (not echoed[j] and req.logprobs is not None and not c.finished()
                        and len(out.prompt_logprobs or ()) < len(out.prompt_token_ids)):
                    continue  # the echo waits for the whole prompt's logprobs (a chunked prefill; n > 1: a
                    # snapshot taken as another choice moved)
                if score_only and not c.finished():
                    continue  # prompt scoring: one chunk per choice, its echo with its finish reason (n > 1: a
                    # later choice's echo came with finish_reason null, then an empty chunk with "length")
                text, ids, lps = d.next(c)
                if score_only:
                    text, ids, lps = "", [], []
                done = c.finished()
                if not (text or done or not echoed[j] or (ids and (req.logprobs is not None or req.return_token_ids))):
                    continue  # another choice moved, or this one's new text is held back: no empty chunk
                lp_ids, lp_entries = ids, lps
                if not echoed[j]:
                    text = _prompt_text(engine, out) + text
                    if req.logprobs is not None:
                        lp_ids, lp_entries = list(out.prompt_token_ids) + ids, list(out.prompt_logprobs) + lps
                    echoed[j] = True
                choice: Dict[str, Any] = {"index": j, "text": text, "logprobs": None,
                                          "finish_reason": ("length" if score_only else c.finish_reason)
                                          if done else None,
                                          "stop_reason": c.stop_reason if done and not score_only else None}
                if req.logprobs is not None:
                    lp = _completion_logprobs(engine, lp_ids, lp_entries, req.logprobs, d.logprob_offset)
                    if lp["tokens"]:
                        d.logprob_offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
                    choice["logprobs"] = lp
                if req.return_token_ids:
                    choice["token_ids"] = ids
                d.done = done
                usage = None
                if continuous:
                    usage = _usage_so_far(len(out.prompt_token_ids), 0 if score_only else len(c.token_ids))
                yield chunk([choice], usage)
        if any(f is None for f in finals):
            return  # the client went away; every request was aborted
        if _final_usage(req):
            usage = _usage(finals, ctx.enable_prompt_tokens_details)  # type: ignore[arg-type]
            if score_only:
                usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
            yield chunk([], usage)
        yield "data: [DONE]\n\n"
    except (RequestError, EngineDeadError, OpenAIError) as exc:
        yield _stream_error_events(exc)
    except Exception as exc:  # anything else mid-stream: an error event and [DONE], not a cut connection (vLLM)
        logger.exception("error in a streamed completion")
        yield _stream_error_events(internal_error(exc))
    finally:
        await merged.aclose()


async def _chat_sse(ctx: ServerContext, req: ChatCompletionRequest, streams: List[RequestStream],
                    params: SamplingParams, rid: str, request: Request,
                    prompt_tokens: int = 0) -> AsyncIterator[str]:
    """A role chunk per choice, then one chunk per choice that has news (``prompt_tokens``: the
    prompt's length, for the role chunks' usage under continuous usage stats)."""
    created = int(time.time())
    deltas = [_Delta(_holdback(params)) for _ in range(params.n)]
    final: Optional[RequestOutput] = None
    continuous = _continuous_usage(req)

    def chunk(choices: List[Dict[str, Any]], usage: Optional[Dict[str, Any]] = None) -> str:
        body: Dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": _model_name(ctx, req), "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return _sse(body)

    merged = _merged(streams, request)
    try:
        for j in range(params.n):
            yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}], _usage_so_far(prompt_tokens, 0) if continuous else None)
        async for _, out in merged:
            if out.finished:
                final = out
            for c in out.outputs:
                d = deltas[c.index]
                if d.done:
                    continue
                text, ids, lps = d.next(c)
                done = c.finished()
                if not (text or done or (ids and (req.logprobs or req.return_token_ids))):
                    continue  # another choice moved, or this one's new text is held back: no empty chunk
                choice: Dict[str, Any] = {"index": c.index, "delta": {"content": text}, "logprobs": None,
                                          "finish_reason": c.finish_reason if done else None,
                                          "stop_reason": c.stop_reason if done else None}
                if req.logprobs:
                    choice["logprobs"] = _chat_logprobs(ctx.engine, ids, lps, req.top_logprobs or 0)
                if req.return_token_ids:
                    choice["token_ids"] = ids
                d.done = done
                usage = _usage_so_far(len(out.prompt_token_ids), len(c.token_ids)) if continuous else None
                yield chunk([choice], usage)
        if final is None:
            return
        if _final_usage(req):
            yield chunk([], _usage([final], ctx.enable_prompt_tokens_details))
        yield "data: [DONE]\n\n"
    except (RequestError, EngineDeadError, OpenAIError) as exc:
        yield _stream_error_events(exc)
    except Exception as exc:  # anything else mid-stream: an error event and [DONE], not a cut connection (vLLM)
        logger.exception("error in a streamed chat completion")
        yield _stream_error_events(internal_error(exc))
    finally:
        await merged.aclose()

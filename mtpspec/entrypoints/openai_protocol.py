"""Request bodies of the OpenAI-compatible server (pydantic) and the OpenAI-style error object.

Fields follow OpenAI's legacy Completions and Chat Completions APIs; extensions (vLLM's names)
are marked. Unknown fields are ignored, as vLLM does (the server logs a warning naming them:
"The following fields were present in the request but ignored: {...}"), except vLLM's fields that
would change the output (``min_p``, beam search, guided decoding, ...: ``openai_server.UNSERVED_FIELDS``),
a 400 naming the field when set; the completions-only
``best_of`` is still a 400 in chat. ``response_format`` is accepted only as ``{"type": "text"}``
(there is no guided decoding). ``n`` (both endpoints) and ``best_of`` (completions only, as in OpenAI's API) are
served through the engine's parallel sampling (:mod:`mtpspec.engine.parallel_sampling`); their
bad values are 400s with vLLM's messages. The unsupported ``suffix`` is accepted only empty and
otherwise rejected with a 400 that names it.
``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (OpenAI) and
``repetition_penalty``, ``min_tokens``, ``prompt_logprobs`` and ``add_special_tokens`` (vLLM's extensions) are served.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class OpenAIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``.

    Args:
        status: HTTP status (400 bad request, 503 overloaded, 500 internal).
        message: what was wrong and what was expected.
        type: OpenAI's error type (``invalid_request_error``, ``server_error``, ...).
        param: the offending body field, if any.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def bad_request(message: str, param: Optional[str] = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param)


def internal_error(exc: BaseException) -> OpenAIError:
    """A 500 ``server_error`` naming the exception's type and message (an unexpected failure in a handler)."""
    return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


class StreamOptions(BaseModel):
    """``include_usage`` (default true, as vLLM: ``stream_options: {}`` asks for usage): a last chunk
    with the request's usage; ``continuous_usage_stats`` (vLLM's extension, with ``include_usage``):
    every chunk also carries its choice's usage so far. ``null`` reads as false (as in vLLM)."""

    model_config = ConfigDict(extra="ignore")
    include_usage: Optional[bool] = True
    continuous_usage_stats: Optional[bool] = False


#: boolean fields OpenAI's API documents as "boolean or null" (completions' ``logprobs`` is an int or
#: null and stays one: leaving it out means null there too)
_NULL_MEANS_DEFAULT = ("stream", "echo", "logprobs")


class _Sampling(BaseModel):
    """Fields shared by both endpoints. Strict types: ``"12"`` or ``true`` for ``max_tokens`` and
    ``"yes"`` for a flag are 400s, not coerced (an int is still accepted where a float is)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_reads_as_default(cls, data: Any) -> Any:
        """``stream``, ``echo`` and chat's ``logprobs`` are "boolean or null" in OpenAI's API (vLLM:
        ``Optional[bool] = False``): ``null`` means the default (false), not a 400."""
        if isinstance(data, dict) and any(data.get(k, False) is None for k in _NULL_MEANS_DEFAULT):
            data = {k: v for k, v in data.items() if not (k in _NULL_MEANS_DEFAULT and v is None)}
        return data

    model: Optional[str] = None
    # unset (None): the model's generation_config.json default, else 1.0
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = Field(default=None, description="extension: 0 or -1 = off")
    n: Optional[int] = Field(default=1, description="choices per prompt (null = 1)")
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = Field(default=None, description="extension")
    seed: Optional[int] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    repetition_penalty: Optional[float] = Field(default=None, description="extension: 1 = off")
    min_tokens: int = Field(default=0, description="extension: EOS / stop ids suppressed before it")
    logit_bias: Optional[Dict[str, float]] = None
    prompt_logprobs: Optional[int] = Field(default=None, description="extension: top-N per prompt token")
    user: Optional[str] = None
    ignore_eos: bool = Field(default=False, description="extension")
    skip_special_tokens: bool = Field(default=True, description="extension")
    return_token_ids: bool = Field(default=False, description="extension: token ids in every choice")
    include_stop_str_in_output: bool = Field(default=False, description="extension: keep a matched stop string")
    response_format: Optional[Dict[str, Any]] = Field(default=None, description='only {"type": "text"}')
    request_id: Optional[str] = Field(default=None, description="extension (vLLM's): the response's id is "
                                                                "<cmpl|chatcmpl>-<request_id>")


class CompletionRequest(_Sampling):
    """``POST /v1/completions``.

    ``prompt``: a string, a list of strings, a list of token ids, or a list of token-id lists
    (one choice per prompt, ``index`` = prompt position). ``max_tokens``: default 16; ``None``
    = until the context is full; ``0`` only with ``echo`` (score the prompt, generate nothing).
    ``logprobs``: 0..``--max-logprobs`` (20) alternatives per token, from the logits the engine sampled or verified
    with (streaming too); with ``echo`` also for the prompt tokens (from the prefill's logits).
    ``n``: choices per prompt (choice ``index`` = prompt position * n + i); ``best_of``: candidates
    per prompt of which the ``n`` with the highest cumulative log-probability are returned (not
    streamed: with ``stream`` the whole response comes as one event, as vLLM does).
    """

    prompt: Union[str, List[str], List[int], List[List[int]]]
    add_special_tokens: bool = Field(default=True, description="extension (vLLM's): text prompts tokenized with "
                                                               "the tokenizer's special tokens (e.g. BOS)")
    max_tokens: Optional[int] = 16
    echo: bool = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    #: any role, as vLLM takes any (a template may know ``ipython``, ``function``, ...); the plain
    #: template knows system, developer, user, assistant and tool, and refuses others with a 400
    role: str
    content: Union[str, List[Dict[str, Any]], None] = None

    def as_dict(self) -> Dict[str, Any]:
        """Every field sent, ``content`` as :meth:`text` (for
        :func:`~mtpspec.entrypoints.chat_template.render_chat`, whose ``template_message`` picks
        the fields a template sees).

        Raises:
            OpenAIError: as :meth:`text`.
        """
        return {**self.model_dump(), "content": self.text()}

    def text(self) -> str:
        """The message's text (:func:`~mtpspec.entrypoints.chat_template.message_text`: text parts
        joined with newlines, as vLLM joins them).

        Raises:
            OpenAIError: a part other than text (images are not supported), or one without text.
        """
        from mtpspec.entrypoints.chat_template import message_text
        try:
            return message_text(self.content)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` (newer name) wins over ``max_tokens``;
    ``logprobs`` / ``top_logprobs`` as in OpenAI's chat API."""

    messages: List[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = Field(default=True, description="extension")
    tools: Optional[List[Dict[str, Any]]] = Field(
        default=None, description="tool definitions for the chat template (only with tool_choice \"none\": no "
                                  "tool calls are parsed out of the output)")
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    continue_final_message: bool = Field(default=False, description="extension (vLLM's): leave the last message "
                                                                    "(usually the assistant's) open for the model to "
                                                                    "go on with it; "
                                                                    "needs add_generation_prompt false")
    add_special_tokens: bool = Field(default=False, description="extension (vLLM's): the rendered template "
                                                                "tokenized with the tokenizer's special tokens "
                                                                "too (the template writes its own)")
    chat_template_kwargs: Optional[Dict[str, Any]] = Field(
        default=None, description="extension (vLLM's): more variables for the tokenizer's chat template, e.g. "
                                  "{\"enable_thinking\": false}")
    best_of: Optional[int] = Field(default=None, description="completions only: a 400 when set")
    documents: Optional[List[Dict[str, str]]] = Field(
        default=None, description="extension (vLLM's): documents for the chat template's `documents` variable (RAG)")


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's extension): ``prompt`` text, or chat ``messages``."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[List[ChatMessage]] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Optional[List[Dict[str, Any]]] = None
    # vLLM's defaults: True for a prompt, False for messages (the chat template writes its own)
    add_special_tokens: Optional[bool] = None
    return_token_strs: Optional[bool] = Field(default=False, description="vLLM's: also each token's string, "
                                                                         "`token_strs`")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    tokens: List[int]

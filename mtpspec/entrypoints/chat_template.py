"""Chat messages -> one prompt string for ``/v1/chat/completions``.

The template given by ``serve --chat-template`` (a file or the template itself, as vLLM's flag:
:func:`load_chat_template`; set as the tokenizer's ``chat_template``) is used when given, else the
tokenizer's own chat template when it has one (a ``transformers`` tokenizer with
``chat_template``, e.g. from ``tokenizer_config.json`` or ``chat_template.jinja``). Otherwise the
**plain template** below is used; it is written for the bundled demo model, which was trained
on GSM8K text in lm-evaluation-harness's format, so a chat turn reads like a solved example:

==============  =================================
role            rendered as
==============  =================================
``system``      ``{content}\\n\\n``
``developer``   ``{content}\\n\\n`` (as system)
``user``        ``Question: {content}\\n``
``assistant``   ``Answer: {content}\\n\\n``
``tool``        ``{content}\\n``
==============  =================================

followed by ``Answer:`` when ``add_generation_prompt`` is true (the default). With the plain
template the server also stops at ``"Question:"`` (the start of the next turn), as
lm-evaluation-harness does for GSM8K.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

PLAIN_STOP = "Question:"
logger = logging.getLogger(__name__)


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` (an mtpspec ``Tokenizer``) carries a usable chat template (one given
    by ``--chat-template``, or the backend's own)."""
    if getattr(tokenizer, "chat_template", None):
        return True
    backend = getattr(tokenizer, "backend", None)
    return bool(getattr(backend, "chat_template", None)) and hasattr(backend, "apply_chat_template")


#: Characters that mark a ``--chat-template`` value as a template, not a file name (vLLM's test).
_TEMPLATE_CHARS = "{}\n"


def load_chat_template(value: str, name: str = "--chat-template", decode_escapes: bool = True) -> str:
    """The Jinja chat template that ``value`` names: the text of the file ``value`` when one exists,
    else ``value`` itself when it holds ``{``, ``}`` or a newline (an inline template, as vLLM's
    ``--chat-template`` takes one; with ``decode_escapes`` its backslash escapes, e.g. ``\\n``, are
    decoded as vLLM's flag decodes them). Checked by compiling it as transformers' renderer does
    (its Jinja extensions, e.g. ``{% break %}``, included).

    Args:
        value: a file or a template.
        name: what errors call it (``--chat-template``; ``LLM.chat``'s ``chat_template``).
        decode_escapes: decode an inline template's escapes (the command line's single-line form).

    Raises:
        ValueError: ``value`` is empty, a directory, looks like a path but no such file exists, the
            file cannot be read or is empty, or the template does not compile (the message names
            the line).
    """
    if not value:
        raise ValueError(f"{name} must not be empty (leave it out for the tokenizer's own template)")
    if os.path.isdir(value):
        raise ValueError(f"{name} {value!r} is a directory; give a template file (e.g. its chat_template.jinja) "
                         "or the template itself")
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{name} {value!r}: cannot read the file: {exc}") from None
        where = f"file {value!r}"
    elif any(c in value for c in _TEMPLATE_CHARS):
        # the single-line form: escapes such as \\n are read as Python's (vLLM does the same); other
        # characters, non-ASCII included, stay as they are
        text = value.encode("latin-1", "backslashreplace").decode("unicode_escape") if decode_escapes else value
        where = "the inline template"
    else:
        raise ValueError(f"{name} {value!r}: no such file, and not a Jinja template (a template holds "
                         "'{{ ... }}' or '{% ... %}'); give a template file or the template itself")
    if not text.strip():
        raise ValueError(f"{name}: {where} is empty")
    syntax = template_syntax_error(text)
    if syntax is not None:
        raise ValueError(f"{name}: {where} is not a valid Jinja template ({syntax})")
    return text


def template_syntax_error(text: str) -> Optional[str]:
    """``"line N: message"`` when ``text`` does not compile as a chat template, else ``None``:
    compiled by rendering a one-message conversation through transformers' renderer (the same
    environment and extensions as every later render); errors other than syntax (the template
    refusing that conversation) are the conversation's, not the template's."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import render_jinja_template
    try:
        render_jinja_template([[{"role": "user", "content": "hi"}]], chat_template=text)
    except TemplateSyntaxError as exc:
        return f"line {exc.lineno}: {exc.message}"
    except Exception:  # noqa: BLE001 (a refusal of the probe conversation is not a syntax error)
        pass
    return None


#: Content part types whose text joins the message's (vLLM's text kinds; the key holding the text).
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def text_messages(conversation: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One conversation's messages, each with its ``content`` as text (:func:`message_text`), for
    :func:`render_chat` (``LLM.chat`` and ``Tokenizer.apply_chat_template``).

    Raises:
        TypeError: a message that is not a dict with a ``role`` string, or content
            :func:`message_text` refuses; named ``message j: ...``.
    """
    out = []
    for j, m in enumerate(conversation):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TypeError(f"message {j}: expected a dict with a 'role' string and a text 'content' (a string, "
                            f"text parts or null), got {m!r}")
        try:
            out.append({**m, "content": message_text(m.get("content"))})
        except ValueError as exc:
            raise TypeError(f"message {j}: {exc}") from None
    return out


def message_text(content: Any) -> str:
    """A chat message's ``content`` as text: a string as it is, ``None`` as ``""``, a list of
    parts joined with newlines (as vLLM joins them for templates that take string content, its
    "string" content format; mtpspec passes every template the joined string, also those that
    loop over content parts, which vLLM's "openai" format feeds the list). Text parts are
    ``{"type": "text" | "input_text" | "output_text", "text": ...}`` and ``{"type": "refusal",
    "refusal": ...}``; one whose text is missing or null is skipped with a warning, as vLLM skips it.

    Raises:
        ValueError: a part of another type (images and audio are not supported; named by index), a
            text that is not a string, or content of another type.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"content must be a string, a list of text parts or null, got {type(content).__name__}")
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        key = TEXT_PARTS.get(kind) if isinstance(part, dict) else None
        if key is None:
            raise ValueError(f"content part {i}: only text parts ({{'type': 'text', 'text': ...}}) are supported, "
                             f"got {kind!r}")
        text = part.get(key)
        if text is None:
            logger.warning("content part %d (type %r) has no %r: skipped", i, kind, key)
            continue
        if not isinstance(text, str):
            raise ValueError(f"content part {i}: a {kind} part's {key!r} must be a string, got {text!r}")
        out.append(text)
    return "\n".join(out)


Message = Union[Tuple[str, str], Dict[str, Any]]


def as_message_dicts(messages: Sequence[Message]) -> List[Dict[str, Any]]:
    """``messages`` as message dicts (read, never changed): a ``(role, text)`` pair becomes
    ``{"role", "content"}``; a dict is taken as it is, its ``content`` already text
    (:func:`message_text`; :func:`template_message` picks the fields a template sees)."""
    return [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages]


def check_continue_final(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """vLLM's rule for ``continue_final_message`` (the last message is left open, for the model to
    go on with it: usually the assistant's, but any role may be continued, as in vLLM).

    Raises:
        ValueError: both it and ``add_generation_prompt`` set.
    """
    if continue_final_message and add_generation_prompt:
        raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")


def template_message(message: Dict[str, Any]) -> Dict[str, Any]:
    """``message`` as chat templates see it, the fields vLLM passes them: ``role``, ``content``,
    ``name`` (a string), an assistant's ``tool_calls`` (not null; an empty list dropped, so the
    template takes its plain assistant path; each call's ``function.arguments`` as a dict: OpenAI
    clients send a JSON string, and an empty one, malformed JSON or JSON that is not an object
    becomes ``{}``, the last two with a warning, so a conversation whose history holds one can go
    on) and ``reasoning`` / ``reasoning_content`` (either one given: both), a tool message's
    ``tool_call_id``, a developer message's ``tools``. Other fields are left out. The caller's
    dicts are not changed.

    Raises:
        ValueError: a ``tool_calls`` entry that is not an object, or not of type ``"function"``
            with a ``function`` object (vLLM's 400s).
    """
    role = message.get("role")
    out: Dict[str, Any] = {"role": role, "content": message.get("content")}
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and not calls):
            out["tool_calls"] = _tool_calls(calls) if isinstance(calls, list) else calls
        reasoning = message.get("reasoning")
        reasoning = message.get("reasoning_content") if reasoning is None else reasoning
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    elif role == "developer":
        out["tools"] = message.get("tools")
    return out


def _tool_calls(calls: List[Any]) -> List[Dict[str, Any]]:
    out = []
    for i, item in enumerate(calls):
        if not isinstance(item, dict):
            raise ValueError(f"assistant tool_calls entries must be objects (tool_calls[{i}] is "
                             f"{type(item).__name__})")
        fn = item.get("function")
        if item.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"chat completions only support assistant tool_calls of type 'function' with a "
                             f"'function' object (tool_calls[{i}])")
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                logger.warning("tool call %r: arguments are not valid JSON (%d chars); passed to the template as {}",
                               fn.get("name"), len(fn["arguments"]))
                args = {}
        if not isinstance(args, dict):
            if args:  # valid JSON but not an object ("[]", "42", ...): templates need a mapping
                logger.warning("tool call %r: arguments are a %s, not a JSON object; passed to the template as {}",
                               fn.get("name"), type(args).__name__)
            args = {}
        out.append({**item, "function": {**fn, "arguments": args}})
    return out


#: What ends each role's turn in the plain template (left off the last message under
#: ``continue_final_message``).
_PLAIN_TURNS = {"system": ("", "\n\n"), "developer": ("", "\n\n"), "user": ("Question: ", "\n"),
                "assistant": ("Answer: ", "\n\n"), "tool": ("", "\n")}


def render_plain(messages: Sequence[Message], add_generation_prompt: bool = True,
                 continue_final_message: bool = False) -> str:
    """The plain template (see the module docstring) of ``(role, text)`` pairs (or message dicts);
    with ``continue_final_message`` the last message ends after its text (no line breaks), for the
    model to go on from its last character."""
    check_continue_final(add_generation_prompt, continue_final_message)
    msgs = as_message_dicts(messages)
    parts: List[str] = []
    for i, m in enumerate(msgs):
        role, text = m.get("role"), m.get("content") or ""
        if role not in _PLAIN_TURNS:
            raise ValueError(f"unknown chat role {role!r}; expected system, developer, user, assistant or tool")
        head, end = _PLAIN_TURNS[role]
        parts.append(head + text + ("" if continue_final_message and i == len(msgs) - 1 else end))
    if add_generation_prompt:
        parts.append("Answer:")
    return "".join(parts)


#: Arguments of ``apply_chat_template`` that ``template_kwargs`` may not set (the renderer sets them).
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                            "chat_template", "tools", "documents", "continue_final_message")


def check_template_kwargs(template_kwargs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``template_kwargs`` as a dict (``None``: empty).

    Raises:
        TypeError: not a dict (nor ``None``).
        ValueError: it sets one of :data:`RESERVED_TEMPLATE_KWARGS` (named).
    """
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise TypeError(f"chat_template_kwargs must be a dict of template variables, got "
                        f"{type(template_kwargs).__name__}")
    kwargs = dict(template_kwargs or {})
    taken = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)} (the server sets "
                         f"{', '.join(RESERVED_TEMPLATE_KWARGS)}); pass template variables only")
    return kwargs


def render_chat(tokenizer: Any, messages: Sequence[Message],
                add_generation_prompt: bool = True,
                template_kwargs: Optional[Dict[str, Any]] = None,
                chat_template: Optional[str] = None,
                continue_final_message: bool = False,
                tools: Optional[List[Dict[str, Any]]] = None,
                documents: Optional[List[Dict[str, Any]]] = None) -> Tuple[str, List[str]]:
    """The prompt text and the default stop strings for a conversation.

    Args:
        tokenizer: the engine's tokenizer (or ``None``).
        messages: ``(role, text)`` pairs or message dicts (``role``, ``content`` as text, and any
            fields vLLM passes templates: ``name``, ``tool_calls``, ``tool_call_id``, ...:
            :func:`template_message`), oldest first (at least one).
        add_generation_prompt: end with the assistant's turn opener.
        template_kwargs: more variables for the tokenizer's chat template (vLLM's
            ``chat_template_kwargs``, e.g. ``{"enable_thinking": False}``); the plain template has
            no variables and ignores them, as a template ignores variables it does not use.
        chat_template: a Jinja template used instead of the tokenizer's (``LLM.chat``'s
            ``chat_template``); default: the tokenizer's ``chat_template`` (``--chat-template``),
            else the backend's own, else the plain template.
        continue_final_message: leave the last message (usually the assistant's) open, for the
            model to go on with it (vLLM's extension; needs ``add_generation_prompt`` false).
        tools: OpenAI tool definitions (``{"type": "function", "function": {...}}``) for the
            template's ``tools`` variable, as vLLM passes a request's ``tools``; the plain
            template has none and ignores them. Nothing parses tool calls out of the output.
        documents: the template's ``documents`` variable (RAG), as vLLM passes a request's
            ``documents``; the plain template ignores them.

    Returns:
        ``(prompt, stops)``: ``stops`` is ``["Question:"]`` for the plain template, else ``[]``.

    Raises:
        ValueError: no messages, an unknown role, ``continue_final_message`` with
            ``add_generation_prompt``, a malformed ``tool_calls`` entry, ``tools`` not a list of
            objects, ``template_kwargs`` setting one of
            :data:`RESERVED_TEMPLATE_KWARGS`, a template that does not parse, or the template
            refusing the conversation (its ``raise_exception(...)``, a jinja2 ``TemplateError``) or
            failing on it (any other error while rendering): vLLM answers those with a 400.
    """
    if not messages:
        raise ValueError("messages must hold at least one message")
    kwargs = check_template_kwargs(template_kwargs)
    conv = [template_message(m) for m in as_message_dicts(messages)]
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"tools must be a list of tool objects ({{'type': 'function', 'function': {{...}}}}), "
                         f"got {tools!r}"[:300])
    check_continue_final(add_generation_prompt, continue_final_message)
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if chat_template or has_chat_template(tokenizer):
        from jinja2 import TemplateError, TemplateSyntaxError
        template = chat_template or getattr(tokenizer, "chat_template", None)  # None: the backend's own
        try:
            backend = getattr(tokenizer, "backend", None)
            if hasattr(backend, "apply_chat_template"):  # with its special tokens (bos_token, ...)
                text = backend.apply_chat_template(conv, tools=tools, documents=documents, tokenize=False,
                                                   chat_template=template,
                                                   add_generation_prompt=add_generation_prompt, **kwargs)
            else:  # a bare tokenizer.json (or none): transformers' renderer, the EOS token as eos_token
                from transformers.utils.chat_template_utils import render_jinja_template
                eos = getattr(tokenizer, "eos_token_id", None)
                special = {"eos_token": backend.id_to_token(eos)} if backend is not None and eos is not None else {}
                text = render_jinja_template([conv], tools=tools, documents=documents, chat_template=template,
                                             add_generation_prompt=add_generation_prompt, **special, **kwargs)[0][0]
        except TemplateSyntaxError as exc:
            raise ValueError(f"the chat template is not valid Jinja (line {exc.lineno}: {exc.message})") from None
        except TemplateError as exc:
            raise ValueError(f"the chat template refused the conversation: {exc}") from None
        except Exception as exc:  # noqa: BLE001 (the template's code failed on this conversation: vLLM's 400 too,
            # e.g. a message it cannot format, a division by zero; never the engine's fault)
            raise ValueError(f"the chat template failed on this conversation: {type(exc).__name__}: {exc}") from None
        return str(text), []
    return render_plain(conv, add_generation_prompt, continue_final_message), [PLAIN_STOP]

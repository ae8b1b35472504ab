"""Chat messages -> one prompt string for ``/v1/chat/completions``.

The tokenizer's own chat template is used when it has one (a ``transformers`` tokenizer with
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

from typing import Any, Dict, List, Optional, Sequence, Tuple

PLAIN_STOP = "Question:"


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` (an mtpspec ``Tokenizer``) carries a usable chat template."""
    backend = getattr(tokenizer, "backend", None)
    return bool(getattr(backend, "chat_template", None)) and hasattr(backend, "apply_chat_template")


def render_plain(messages: Sequence[Tuple[str, str]], add_generation_prompt: bool = True) -> str:
    """The plain template (see the module docstring) of ``(role, text)`` pairs."""
    parts: List[str] = []
    for role, text in messages:
        if role in ("system", "developer"):
            parts.append(f"{text}\n\n")
        elif role == "user":
            parts.append(f"Question: {text}\n")
        elif role == "assistant":
            parts.append(f"Answer: {text}\n\n")
        elif role == "tool":
            parts.append(f"{text}\n")
        else:
            raise ValueError(f"unknown chat role {role!r}; expected system, developer, user, assistant or tool")
    if add_generation_prompt:
        parts.append("Answer:")
    return "".join(parts)


#: Arguments of ``apply_chat_template`` that ``template_kwargs`` may not set (the renderer sets them).
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                            "chat_template", "tools", "documents")


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


def render_chat(tokenizer: Any, messages: Sequence[Tuple[str, str]],
                add_generation_prompt: bool = True,
                template_kwargs: Optional[Dict[str, Any]] = None) -> Tuple[str, List[str]]:
    """The prompt text and the default stop strings for a conversation.

    Args:
        tokenizer: the engine's tokenizer (or ``None``).
        messages: ``(role, text)`` pairs, oldest first (at least one).
        add_generation_prompt: end with the assistant's turn opener.
        template_kwargs: more variables for the tokenizer's chat template (vLLM's
            ``chat_template_kwargs``, e.g. ``{"enable_thinking": False}``); the plain template has
            no variables and ignores them, as a template ignores variables it does not use.

    Returns:
        ``(prompt, stops)``: ``stops`` is ``["Question:"]`` for the plain template, else ``[]``.

    Raises:
        ValueError: no messages, an unknown role, ``template_kwargs`` setting one of
            :data:`RESERVED_TEMPLATE_KWARGS`, or the tokenizer's template refusing the conversation
            (its ``raise_exception(...)``, a jinja2 ``TemplateError``: vLLM answers those with a 400).
    """
    if not messages:
        raise ValueError("messages must hold at least one message")
    kwargs = check_template_kwargs(template_kwargs)
    if has_chat_template(tokenizer):
        from jinja2 import TemplateError
        conv = [{"role": r, "content": t} for r, t in messages]
        try:
            text = tokenizer.backend.apply_chat_template(conv, tokenize=False,
                                                         add_generation_prompt=add_generation_prompt, **kwargs)
        except TemplateError as exc:
            raise ValueError(f"the chat template refused the conversation: {exc}") from None
        except (TypeError, RuntimeError) as exc:  # e.g. a message the template cannot format: vLLM's 400 too
            raise ValueError(f"the chat template failed on this conversation: {type(exc).__name__}: {exc}") from None
        return str(text), []
    return render_plain(messages, add_generation_prompt), [PLAIN_STOP]

"""A checkpoint's ``generation_config.json``: extra EOS ids and the model creator's default sampling settings.

vLLM's rules (``--generation-config``; ``ModelConfig.try_get_generation_config`` /
``get_diff_sampling_param``): ``"auto"`` (the default) and ``"vllm"`` read the model folder's file,
any other value is a folder holding one. Every ``eos_token_id`` in it ends a request like
``config.json``'s, whatever the setting (a list of ids, e.g. end-of-turn tokens, is common). Except
under ``"vllm"``, the ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty`` and
``max_new_tokens`` (as ``max_tokens``) the file sets are the defaults of requests that leave them
unset (``LLM.generate`` without sampling params, ``LLM.get_default_sampling_params()``, the OpenAI
server's omitted fields), and the server also caps every request's ``max_tokens`` by the file's
(vLLM's ``get_max_tokens``). "Sets": present and not null, as ``GenerationConfig.to_diff_dict`` of
transformers 5 keeps them (its defaults are all unset). One difference: vLLM makes the file's EOS
ids other than the tokenizer's stop ids (``stop_reason`` = the id); here they are EOS ids
(``stop_reason`` ``None``).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, Set

logger = logging.getLogger(__name__)

#: ``--generation-config`` values besides a folder.
GENERATION_CONFIG_CHOICES = ("auto", "vllm")
# the fields that become defaults
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens")
# fields mtpspec does not sample with, and their neutral values
_UNSUPPORTED = {"min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}


def load_generation_config(model_path: str, setting: str = "auto") -> Dict[str, Any]:
    """The parsed ``generation_config.json`` (``{}`` for a model folder without one).

    Args:
        model_path: the model folder (read with ``"auto"`` and ``"vllm"``).
        setting: ``"auto"``, ``"vllm"`` or a folder holding ``generation_config.json``.

    Raises:
        ValueError: ``setting`` names a folder that does not exist or holds no
            ``generation_config.json``; the file is not valid JSON or not an object (the message
            names the file).
    """
    folder = model_path if setting in (None, "auto", "vllm") else setting
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if setting not in (None, "auto", "vllm"):
            raise ValueError(f"--generation-config {setting!r}: expected 'auto', 'vllm' or a folder holding "
                             "generation_config.json; there is none there")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it as JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def generation_eos_token_ids(gen: Dict[str, Any]) -> Set[int]:
    """The ``eos_token_id`` ids of a generation config (an int or a list of ints; ``null``: none).

    Raises:
        ValueError: another type, or a negative id.
    """
    v = gen.get("eos_token_id")
    if v is None:
        return set()
    ids = [v] if isinstance(v, int) and not isinstance(v, bool) else v
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"generation_config.json: eos_token_id must be an id >= 0 or a list of them, got {v!r}")
    return set(ids)


def default_sampling_fields(gen: Dict[str, Any], setting: str = "auto") -> Dict[str, Any]:
    """``SamplingParams`` keyword arguments the generation config sets (see the module docstring;
    ``max_new_tokens`` becomes ``max_tokens``), e.g. ``{"temperature": 0.6, "top_p": 0.95}``; none
    under ``setting == "vllm"``. Fields mtpspec does not sample with (``min_p``, ...) are named in a
    warning and left out."""
    if setting == "vllm":
        return {}
    out = {}
    for key in _SAMPLING_KEYS:
        val = gen.get(key)
        if val is not None:
            out["max_tokens" if key == "max_new_tokens" else key] = val
    skipped = [k for k, neutral in _UNSUPPORTED.items() if gen.get(k) is not None and gen.get(k) != neutral]
    if skipped:
        logger.warning("generation_config.json sets %s, which mtpspec's sampler does not implement; ignored",
                       ", ".join(skipped))
    if out:
        logger.warning("default sampling parameters come from the model's generation_config.json: %s (requests "
                       "that set them are unaffected, except that `mtpspec serve` caps max_tokens at max_new_tokens, "
                       "as vLLM's server does; --generation-config vllm ignores these defaults)", out)
    return out


__all__ = ["GENERATION_CONFIG_CHOICES", "default_sampling_fields", "generation_eos_token_ids",
           "load_generation_config"]

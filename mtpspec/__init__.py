"""mtpspec: tensor-parallel speculative decoding with MTP draft layers.

``from mtpspec import LLM, SamplingParams`` imports the engine lazily, so ``import mtpspec``
stays light (no torch import until one of these names is used).
"""

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "mtpspec.engine.llm",
    "SamplingParams": "mtpspec.sampling_params",
    "RequestOutput": "mtpspec.outputs",
    "CompletionOutput": "mtpspec.outputs",
    "RequestMetrics": "mtpspec.outputs",
    "Logprob": "mtpspec.outputs",
}

__all__ = ["__version__", "demo_model_path", *_LAZY]


def demo_model_path() -> str:
    """Folder of the bundled demo model (``mtpspec/demo_model``), the default of every command."""
    import os
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_model")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mtpspec' has no attribute {name!r}")

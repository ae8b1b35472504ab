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

__all__ = ["__version__", "DEMO_MODELS", "demo_model_path", *_LAZY]


#: The bundled demo models: architecture (``model_type``) -> folder inside the package. The first
#: is the default of every command.
DEMO_MODELS = {"glm_moe_dsa": "demo_model_glm5", "glm4_moe": "demo_model"}


def demo_model_path(arch: str = "glm_moe_dsa") -> str:
    """Folder of a bundled demo model, by architecture: ``"glm_moe_dsa"`` (the default of every
    command: GLM-5 architecture, MLA + DSA indexer + MTP, ``mtpspec/demo_model_glm5``) or
    ``"glm4_moe"`` (GLM-4.5 architecture, ``mtpspec/demo_model``).

    Raises:
        ValueError: another architecture.
    """
    import os
    if arch not in DEMO_MODELS:
        raise ValueError(f"no bundled demo model of architecture {arch!r}; expected one of {sorted(DEMO_MODELS)}")
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), DEMO_MODELS[arch])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mtpspec' has no attribute {name!r}")

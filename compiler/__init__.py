"""kiln: a declarative compiler for LLM inference."""

from kiln.errors import CodegenError, KilnError, PassError, RequestError, SpecError, WeightError

__version__ = "0.1.0"
__all__ = ["CodegenError", "KilnError", "PassError", "RequestError", "SpecError", "WeightError", "__version__"]

# Heavier parts load on first use so `import kiln` stays light: name -> module that defines it.
_LAZY = {
    "explain": "kiln.dynamo.explain",
    "ExplainReport": "kiln.dynamo.explain",
    "LLM": "kiln.llm",
    "SamplingParams": "kiln.runtime.sampling_params",
    "RequestOutput": "kiln.runtime.request",
    "CompletionOutput": "kiln.runtime.request",
    "Logprob": "kiln.runtime.logprob",
}
__all__ += list(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kiln' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

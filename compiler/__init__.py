"""kiln: a declarative compiler for LLM inference."""

from kiln.errors import CodegenError, KilnError, PassError, RequestError, SpecError, WeightError

__version__ = "0.1.0"
__all__ = ["CodegenError", "KilnError", "PassError", "RequestError", "SpecError", "WeightError", "__version__"]

"""vbatch: offline batch inference. `from vbatch import LLM, SamplingParams` mirrors vLLM's API."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .kernels import openmp_env

# Before anything imports torch (and with it the OpenMP runtime): kernels/openmp_env.py.
openmp_env.apply_defaults()

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

if TYPE_CHECKING:
    from vbatch.engine.llm import LLM
    from vbatch.engine.outputs import CompletionOutput, RequestOutput
    from vbatch.engine.sampling_params import SamplingParams

_LAZY = {
    "LLM": "vbatch.engine.llm",
    "SamplingParams": "vbatch.engine.sampling_params",
    "RequestOutput": "vbatch.engine.outputs",
    "CompletionOutput": "vbatch.engine.outputs",
}


def __getattr__(name: str) -> Any:
    # Lazy: `vbatch --help` must not pay for importing torch.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vbatch' has no attribute {name!r}")

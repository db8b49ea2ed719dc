"""vbatch: offline batch inference. `from vbatch import LLM, SamplingParams` mirrors vLLM's API."""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any


def _leave_the_checkout_root_off_sys_path() -> None:
    """Drop the source checkout's root from sys.path, where `python -m` / `python -c` run from it put it.

    NOTE: why. The checkout's top-level folders install as vbatch.* (pyproject.toml's package-dir),
    but with the root on sys.path its `kernels/` is also the top-level module `kernels`, and shadows
    the PyPI package of that name, which transformers (>= 5.25, a dependency) imports when it loads a
    model's config: "cannot import name 'CUDAProperties' from 'kernels'". vbatch's own modules
    import through the installed mapping, never from the root."""
    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    if not os.path.isfile(os.path.join(root, "kernels", "openmp_env.py")):
        return  # an installed copy (site-packages/vbatch): no checkout around it
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]


_leave_the_checkout_root_off_sys_path()

from .kernels import openmp_env, thp_env  # noqa: E402  (after the sys.path fix: they import nothing outside vbatch)

# Before anything imports torch (and with it the OpenMP runtime and torch's allocator):
# kernels/openmp_env.py, kernels/thp_env.py.
openmp_env.apply_defaults()
thp_env.apply_default()

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

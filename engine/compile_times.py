"""CompileTimes: what the engine compiled while it started, and how long that took.

The engine compiles in its (untimed) start-up, never inside a step: the native C kernels on CPU
(built once per machine and source, then reused from $VBATCH_CACHE), inductor's decode attention
on the torch CPU path (no C compiler), CUDA graphs of the decode batch sizes on GPU (their
capture also JIT-compiles the Triton kernels they replay). `vbatch bench` reports it beside the
engine build time, as the speed issue asks ("compile time reported").
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class CompileTimes:
    # finding or building the C kernels' variants during this start-up (None: not used); each loads
    # once per process, so an engine started after its variants loaded reports 0.0 (`native_load`)
    native_kernels_s: float | None = None
    native_kernels_compiled: bool | None = None    # True: compiled in this start-up; False: nothing compiled
    torch_compile_s: float | None = None           # inductor warm-up of the torch CPU path (None: not used)
    cuda_graphs_s: float | None = None             # decode CUDA graph capture incl. Triton JIT (None: not used)

    def to_dict(self) -> dict[str, float | bool | None]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        parts = []
        if self.native_kernels_s is not None:
            how = "compiled now" if self.native_kernels_compiled else "reused build"
            parts.append(f"native C kernels {self.native_kernels_s:.1f} s ({how})")
        if self.torch_compile_s is not None:
            parts.append(f"torch.compile warm-up {self.torch_compile_s:.1f} s")
        if self.cuda_graphs_s is not None:
            parts.append(f"CUDA graph capture {self.cuda_graphs_s:.1f} s")
        return ", ".join(parts) or "nothing compiled (reference ops)"


def native_load(native, started: float) -> dict[str, float | bool | None]:
    """CompileTimes' native fields for an engine whose start-up began at `started` (perf_counter())
    and runs `native` (kernels/cpu_native.NativeKernels, or None): what loading its variants cost this
    start-up. Variants loaded earlier in the process (by another engine, a test, a benchmark script)
    cost it nothing: their compile must not be reported inside this build."""
    if native is None:
        return {"native_kernels_s": None, "native_kernels_compiled": None}
    loads = native.loads_since(started)
    return {"native_kernels_s": sum(load.seconds for load in loads),
            "native_kernels_compiled": any(load.compiled for load in loads)}

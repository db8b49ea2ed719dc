"""The CUDA binding of `kernels.ops`: the Triton kernels in place of the references.

Called only by `ops.get_ops` for CUDA devices, so the CPU path never imports triton. Each
Triton op has its reference's signature; silu_and_mul stays the reference (torch fuses
nothing there that a kernel would beat by much). Without triton, CUDA runs the references.
"""
from __future__ import annotations

import dataclasses
import logging

logger = logging.getLogger("vbatch.kernels")


def cuda_ops(reference):  # reference: ops.Ops -> ops.Ops
    try:
        from . import triton_attention, triton_cache, triton_norm, triton_rotary
    except ImportError as err:  # triton missing or broken: the references still run on CUDA
        logger.warning("triton unavailable (%s): CUDA runs the reference ops; pip install 'vbatch[gpu]'", err)
        return reference
    return dataclasses.replace(
        reference, name="triton", graph_capturable=True,
        write_kv_cache=triton_cache.write_kv_cache,
        paged_attention=triton_attention.paged_attention,
        rms_norm=triton_norm.rms_norm,
        fused_add_rms_norm=triton_norm.fused_add_rms_norm,
        apply_rotary=triton_rotary.apply_rotary,
    )

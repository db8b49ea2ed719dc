"""Shared parameters of the native-kernel tests (tests/test_cpu_native*.py): the activation dtypes,
the (activation, KV cache) variants the kernels are built for (kernels/native_build.py VARIANTS),
and the attention's step cases; their fixtures (dtype, variant, any_variant) are conftest.py's.
"""
from __future__ import annotations

import torch

from test_cpu_kernels import CASES, _random_step

DTYPES = [torch.float32, torch.bfloat16]
# (activations, KV cache): native_build.VARIANTS; the half caches under fp32 are the dtype-auto storage
VARIANTS = [(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
            (torch.bfloat16, torch.bfloat16)]
VARIANT_IDS = ["fp32", "fp32-kvfp16", "fp32-kvbf16", "bf16"]
# the fp8 caches (kv_cache_dtype fp8 / fp8_e5m2) under either activations: the attention reads the
# same stored values as the reference (which widens them with .float()), so the same tolerances hold
FP8_VARIANTS = [(torch.float32, torch.float8_e4m3fn), (torch.float32, torch.float8_e5m2),
                (torch.bfloat16, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e5m2)]
FP8_VARIANT_IDS = ["fp32-kve4m3", "fp32-kve5m2", "bf16-kve4m3", "bf16-kve5m2"]

CASES = {**CASES,
         "long_prefill_on_prefix": ([37], [40], 16),      # several 16-row items over many blocks
         "prefills_block_16": ([0, 0, 21, 9], [37, 5, 19, 1], 16),  # the tiled many-row path, ragged tiles
         "prefill_block_32_on_prefix": ([40, 3], [20, 33], 32),
         "block_size_not_multiple_of_16": ([29, 3], [1, 20], 24),
         "many_decodes": ([int(x) for x in torch.randint(0, 90, (40,), generator=torch.Generator().manual_seed(1))],
                          [1] * 40, 16),
         # decode rows over hundreds of positions and many blocks (the longest above: 90 positions)
         "long_decodes": ([300, 530, 255, 256], [1, 1, 1, 1], 16),
         "long_decodes_block_8": ([520, 3], [1, 2], 8),
         "long_decodes_block_512": ([700, 1100], [1, 1], 512),
         # blocks of a size not a multiple of 4: the narrow decode path's quads of keys may cross them
         "decodes_block_6": ([37, 70, 2], [1, 1, 1], 6)}


def random_step(case_or_lens, variant, **kwargs):
    """A random step (test_cpu_kernels._random_step) with the query in variant[0], the caches in variant[1]."""
    dtype, kv_dtype = variant if isinstance(variant, tuple) else (variant, variant)
    context_lens, query_lens, block_size = CASES[case_or_lens] if isinstance(case_or_lens, str) else case_or_lens
    query, key_cache, value_cache, attn, scale = _random_step(context_lens, query_lens, block_size, **kwargs)
    return query.to(dtype), key_cache.to(kv_dtype), value_cache.to(kv_dtype), attn, scale

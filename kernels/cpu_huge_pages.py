"""Long-lived CPU tensors (the model's weights, the KV cache) on transparent huge pages.

    empty(shape, dtype)     a new tensor in memory advised for 2 MiB pages (torch.empty below 2 MiB
                            or where huge pages are off); untouched pages cost nothing, as torch.empty
    place_module(module)    moves every parameter and buffer of `module` into one such arena, in the
                            order the module registers them; returns the bytes moved (0: off)
    available()             whether this process gets huge pages (Linux with THP "always" or
                            "madvise", and VBATCH_HUGE_PAGES not "0"; kernels/thp_env.py)

NOTE: why. A batch-1 decode step streams every weight once (268 MB for SmolLM2-135M with fp16
weights): with 4 KiB pages that is one TLB miss per 4 KiB read, 65,000 page walks a step. torch
allocates with plain pages unless THP_MEM_ALLOC_ENABLE is set before its first allocation
(kernels/thp_env.py sets it when vbatch is imported first; an `LLM` made after `import torch`
misses it), and even then not for a tensor under 2 MiB, as most weights are. THP's default mode,
"madvise", gives huge pages only to memory that asks. Measured on the Intel Xeon with torch held
to AVX2 (session 21, docs/performance/batch-1.md "Huge pages"): the weights in one advised arena made
batch 1 about 4% faster; the 64-prompt run, which computes, did not change.

The arena is an anonymous private mapping (Python's mmap) held by the tensors made from it
(torch.frombuffer keeps the mapping alive), so it is freed with the last of them. Values,
shapes, strides and aliasing are unchanged: tensors that shared a storage share its copy.
oneDNN's opaque packed weights (`is_mkldnn`) have no storage to move and stay where they are.
"""
from __future__ import annotations

import math
import mmap

import torch
from torch import nn

from .thp_env import available

__all__ = ["HUGE_PAGE", "available", "empty", "place_module"]

HUGE_PAGE = 2 << 20      # bytes: x86-64's and aarch64's (4 KiB granule) transparent huge page
_ALIGN = 64              # bytes between tensors in an arena: a cache line, torch's own alignment


def _region(nbytes: int) -> torch.Tensor:  # -> [nbytes] uint8, 2 MiB aligned, advised for huge pages
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:      # a kernel without THP: plain pages, the same memory otherwise
        pass
    raw = torch.frombuffer(mapping, dtype=torch.uint8)                   # keeps `mapping` alive
    start = (-raw.data_ptr()) % HUGE_PAGE
    return raw[start:start + nbytes]


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype=dtype) on the CPU, in memory advised for huge pages when it spans
    at least one (and `available()`)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not available():
        return torch.empty(shape, dtype=dtype)
    return _region(nbytes).view(dtype).view(shape)


def _slots(module: nn.Module) -> list[tuple[dict, str]]:
    """(the dict that holds it, its name) for every CPU parameter and buffer with a storage.
    Names, not tensors: each old storage is freed as soon as its last tensor has moved."""
    out, params = [], set()
    for mod in module.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is None or t.device.type != "cpu" or t.is_mkldnn or id(t) in params:
                    continue
                if isinstance(t, nn.Parameter):
                    params.add(id(t))        # a tied Parameter: one object, moved once
                out.append((table, name))
    return out


def place_module(module: nn.Module) -> int:
    """Move every CPU parameter and buffer of `module` (its submodules included) into one arena
    advised for huge pages, each storage once, in registration order (the order a forward reads
    them); returns the bytes moved, 0 when huge pages are off or the tensors span less than one.

    Call it before anything keeps a tensor's address (the native kernels' layer structs are built
    on the first forward). A Parameter keeps its object (`.data` is replaced), so ties hold. The
    old storages are freed as their tensors move: the peak is the model plus its largest storage,
    not twice the model."""
    slots = _slots(module)
    offsets: dict[int, int] = {}     # storage address -> byte offset in the arena
    total = 0
    for table, name in slots:
        storage = table[name].untyped_storage()
        if storage.data_ptr() not in offsets:
            offsets[storage.data_ptr()] = total
            total += -(-storage.nbytes() // _ALIGN) * _ALIGN
    if total < HUGE_PAGE or not available():
        return 0
    arena = _region(total)
    copied: set[int] = set()
    for table, name in slots:
        t = table[name]
        storage = t.untyped_storage()
        start = offsets[storage.data_ptr()]
        place = arena[start:start + storage.nbytes()]
        if storage.data_ptr() not in copied:
            place.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            copied.add(storage.data_ptr())
        typed = place.view(t.dtype)       # as_strided's offset counts from the mapping's start
        moved = typed.as_strided(t.shape, t.stride(), typed.storage_offset() + t.storage_offset())
        if isinstance(t, nn.Parameter):
            t.data = moved
        else:
            table[name] = moved
        del t, storage
    return total

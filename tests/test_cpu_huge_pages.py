"""The model's weights and the KV cache on transparent huge pages (kernels/cpu_huge_pages.py), and
torch's own allocations told to ask for them before torch loads (kernels/thp_env.py).

The oracle for the advice is the kernel's own account of the mapping (/proc/self/smaps: the
mapping's VmFlags carry "hg" once madvise(MADV_HUGEPAGE) took); for the values, the tensors as
they were before the move. Whether the kernel found free 2 MiB pages at a fault is its business
(it falls back to 4 KiB pages), so no test depends on AnonHugePages.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn

from vbatch.kernels import cpu_huge_pages, thp_env

needs_huge_pages = pytest.mark.skipif(not cpu_huge_pages.available(),
                                      reason="no transparent huge pages here (not Linux, or THP is 'never')")


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping holding `address`: its fields, with "VmFlags"."""
    entry = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:             # "start-end perms offset dev inode [path]"
                start, end = (int(x, 16) for x in head.split("-"))
                entry = {} if start <= address < end else None
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
                if key == "VmFlags":
                    return entry
    raise AssertionError(f"no mapping holds {address:#x}")


def advised(t: torch.Tensor) -> bool:
    return "hg" in mapping_of(t.data_ptr())["VmFlags"].split()


class Block(nn.Module):
    def __init__(self, shared: nn.Parameter) -> None:
        super().__init__()
        self.lin = nn.Linear(512, 1024)
        self.tied = shared                                   # one Parameter in two modules
        self.register_buffer("halves", torch.randn(700, 300).to(torch.float16))
        base = torch.randn(64, 1000)
        self.register_buffer("base", base)
        self.register_buffer("tail", base[3:, 10:])          # a view sharing base's storage
        self.register_buffer("transposed", torch.randn(300, 200).t())
        self.register_buffer("ids", torch.arange(5000, dtype=torch.int64))
        self.register_buffer("absent", None)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shared = nn.Parameter(torch.randn(2000, 384), requires_grad=False)
        self.embed = shared
        self.blocks = nn.ModuleList([Block(shared), Block(shared)])


def test_empty_is_advised_and_aligned_from_one_huge_page():
    small = cpu_huge_pages.empty((1000,), torch.float32)
    assert small.shape == (1000,) and small.dtype == torch.float32
    if not cpu_huge_pages.available():
        pytest.skip("no transparent huge pages here (not Linux, or THP is 'never')")
    assert small._base is None                               # below one huge page: torch.empty's own
    t = cpu_huge_pages.empty((3, 1 << 20), torch.float16)    # 6 MiB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float16 and t.is_contiguous()
    assert t.data_ptr() % cpu_huge_pages.HUGE_PAGE == 0 and advised(t)
    t.fill_(2.5)
    assert float(t[-1, -1]) == 2.5 and float(t.float().sum()) == 2.5 * t.numel()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("VBATCH_HUGE_PAGES", "0")
    assert not cpu_huge_pages.available()
    plain = cpu_huge_pages.empty((4 << 20,), torch.float32)
    assert plain._base is None and plain.shape == (4 << 20,)   # torch.empty's own, not a view of an arena
    model = Model()
    before = {name: t.data_ptr() for name, t in model.named_buffers()}
    assert cpu_huge_pages.place_module(model) == 0
    assert before == {name: t.data_ptr() for name, t in model.named_buffers()}


TORCH_ALLOCATION = """
import json, sys
exec(sys.argv[1])                                  # the imports, in the order under test
import torch
x = torch.empty(8 << 20, dtype=torch.uint8)        # one of torch's own allocations, 8 MiB
sys.path.insert(0, sys.argv[2])
from test_cpu_huge_pages import advised            # this file's reading of /proc/self/smaps
from vbatch.kernels import thp_env
print(json.dumps({"advised": advised(x), "described": thp_env.describe()}))
"""


def _torch_allocation(imports: str, **env: str) -> dict:
    """How a child process's torch allocation came out, the modules imported as `imports` first."""
    child_env = {k: v for k, v in os.environ.items() if k not in (thp_env.TORCH_KNOB, thp_env.SWITCH)} | env
    done = subprocess.run([sys.executable, "-c", TORCH_ALLOCATION, imports, os.path.dirname(__file__)],
                          env=child_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_huge_pages
def test_importing_vbatch_first_gives_torchs_allocations_huge_pages():
    assert _torch_allocation("import vbatch") == {
        "advised": True, "described": "THP_MEM_ALLOC_ENABLE=1 (vbatch's default)"}
    # torch first: its allocator had read its environment already; nothing is claimed
    assert _torch_allocation("import torch, vbatch") == {"advised": False, "described": None}
    # switched off; and a user's own setting is theirs
    assert _torch_allocation("import vbatch", VBATCH_HUGE_PAGES="0")["advised"] is False
    assert _torch_allocation("import vbatch", THP_MEM_ALLOC_ENABLE="1") == {
        "advised": True, "described": "THP_MEM_ALLOC_ENABLE=1"}


def test_peers_get_the_environment_without_vbatchs_huge_page_default(monkeypatch):
    monkeypatch.setattr(thp_env, "_applied", "1")
    assert thp_env.without_default({"THP_MEM_ALLOC_ENABLE": "1", "PATH": "/bin"}) == {"PATH": "/bin"}
    monkeypatch.setattr(thp_env, "_applied", None)      # the user's own: kept
    assert thp_env.without_default({"THP_MEM_ALLOC_ENABLE": "1"}) == {"THP_MEM_ALLOC_ENABLE": "1"}


@needs_huge_pages
def test_place_module_keeps_values_views_and_ties():
    torch.manual_seed(0)
    model = Model()
    model.blocks[0].register_buffer("packed", torch.randn(64, 64).to_mkldnn())  # oneDNN's opaque: stays
    state = {name: (t.clone() if not t.is_mkldnn else t, t.shape, t.stride(), t.dtype)
             for name, t in list(model.named_parameters(remove_duplicate=False))
             + list(model.named_buffers(remove_duplicate=False))}
    packed = model.blocks[0].packed
    old_buffers = [weakref.ref(t) for name, t in model.named_buffers() if not name.endswith("packed")]
    placed = cpu_huge_pages.place_module(model)
    gc.collect()
    assert all(ref() is None for ref in old_buffers)         # nothing keeps the old copies alive
    assert placed >= cpu_huge_pages.HUGE_PAGE
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    assert tensors.keys() == state.keys()
    for name, t in tensors.items():
        old, shape, stride, dtype = state[name]
        if name.endswith("packed"):
            assert t is packed
            continue
        assert (t.shape, t.stride(), t.dtype) == (shape, stride, dtype), name
        assert torch.equal(t, old), name
        assert advised(t), name
    # One arena, 2 MiB aligned, in registration order: the first tensor opens it.
    low = min(t.data_ptr() for n, t in tensors.items() if not n.endswith("packed"))
    assert low == model.embed.data_ptr() and low % cpu_huge_pages.HUGE_PAGE == 0
    assert max(t.data_ptr() for n, t in tensors.items() if not n.endswith("packed")) < low + placed
    # The tied Parameter is still one object; the view still aliases its base.
    assert model.blocks[0].tied is model.embed and model.blocks[1].tied is model.embed
    assert isinstance(model.embed, nn.Parameter) and not model.embed.requires_grad
    block = model.blocks[1]
    block.base[3, 10] = 123.0
    assert float(block.tail[0, 0]) == 123.0
    out = block.lin(torch.ones(2, 512))                       # modules still compute with them
    assert torch.allclose(out, torch.ones(2, 512) @ state["blocks.1.lin.weight"][0].t() + state["blocks.1.lin.bias"][0])


@needs_huge_pages
def test_engine_weights_and_kv_cache_are_advised(smollm2_path):
    from vbatch import LLM, SamplingParams
    llm = LLM(str(smollm2_path), dtype="float32", device="cpu", quiet=True, max_model_len=256,
              kv_cache_memory=256 << 20)   # 4 MiB a layer for K and for V
    runner = llm.engine.runner
    assert runner.huge_pages
    layer = runner.model.layers[3]
    for t in (layer.self_attn.qkv.small_weight, layer.mlp.gate_up.small_weight, layer.mlp.down_proj.small_weight,
              layer.input_layernorm, runner.model.embed_tokens.weight, *runner.kv_caches[3]):
        assert advised(t)
    text = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text
    assert "Paris" in text

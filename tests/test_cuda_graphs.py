"""CUDA-graph decode (engine/cuda_graphs.py): a replay equals the eager forward.

The graph tests need CUDA (marked `gpu`, skipped without it); the capture-size rule runs
anywhere. Oracle: the eager forward of the same tiny random Llama on the same inputs (the
forward writes each token's K/V to its slot, the same values both times, so the order of the
two runs does not matter). Tolerance: fp32 within 1e-4 of the eager output (a captured
batch may run other GEMM kernels than the eager one, so bit equality is not promised).
"""
from __future__ import annotations

import pytest
import torch

from vbatch.engine.cuda_graphs import DecodeGraphs, capture_sizes
from vbatch.kernels.attention_metadata import AttentionMetadata

torch.set_num_threads(1)

no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(256)[-3:] == [224, 240, 256]
    assert capture_sizes(4096)[-1] == 512


def _tiny_llama(device: torch.device):
    from transformers import LlamaConfig

    from vbatch.engine.models.llama import LlamaForCausalLM
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config, dtype=torch.float32, device=device, max_model_len=256)
    gen = torch.Generator().manual_seed(0)
    weights = []
    for name, (target, start, end) in model._weight_slots().items():
        shape = (end - start, *target.shape[1:])
        weights.append((name, 0.1 * torch.randn(shape, generator=gen)))
    model.load_weights(weights)
    return model.eval()


@pytest.mark.gpu
@no_cuda
@pytest.mark.parametrize("num_reqs", [3, 4])   # 3 pads to the captured size 4
def test_graph_replay_equals_eager(num_reqs):
    device = torch.device("cuda")
    model = _tiny_llama(device)
    assert model.ops.name == "triton"
    block_size, num_blocks = 16, 32
    caches = [tuple(torch.randn(model.kv_cache_shape(num_blocks, block_size), device=device) for _ in range(2))
              for _ in range(model.num_layers)]
    graphs = DecodeGraphs(model, caches, block_size, 256, [1, 2, 4], device).capture()

    seq_lens = [17, 5, 40, 33][:num_reqs]
    tables = torch.zeros(num_reqs, 3, dtype=torch.int32)
    next_block = 1
    for r, length in enumerate(seq_lens):
        for b in range(-(-length // block_size)):
            tables[r, b] = next_block
            next_block += 1
    positions = torch.tensor([n - 1 for n in seq_lens])
    slots = tables.gather(1, (positions // block_size)[:, None]).squeeze(1).long() * block_size + positions % block_size
    attn = AttentionMetadata(
        slot_mapping=slots.to(device), query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        context_lens=torch.tensor([n - 1 for n in seq_lens], dtype=torch.int32, device=device),
        block_tables=tables.to(device), block_size=block_size, max_query_len=1, max_seq_len=max(seq_lens),
        query_lens_list=(1,) * num_reqs, seq_lens_list=tuple(seq_lens))
    input_ids = torch.randint(0, 128, (num_reqs,), device=device)
    with torch.inference_mode():
        eager = model(input_ids, positions.to(device), caches, attn).clone()
        assert graphs.can_run(attn)
        replayed = graphs.run(input_ids, positions.to(device), attn).clone()
    diff = (eager - replayed).abs().max().item()
    assert diff <= 1e-4, f"graph replay vs eager: max abs diff {diff:.3g}"

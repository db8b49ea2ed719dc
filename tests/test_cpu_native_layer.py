"""The whole decoder layer in one call (kernels/csrc/cpu_decoder_layer.c) of every CPU tier this
machine runs.

Oracle: the same model running its layers' forward op by op (the native ops, each tested against
its reference in the other test_cpu_native*.py files): the logits must be identical.
"""
from __future__ import annotations

import pytest
import torch

from vbatch.kernels import cpu_native, gemm_libraries

# (activation dtype, weight storage, KV cache): fp32 exact, fp32 with the half formats (dtype auto:
# avx2 fp16, portable bf16), bf16, and the fp8 caches (kv_cache_dtype fp8 / fp8_e5m2)
LAYER_CASES = [(torch.float32, torch.float32, torch.float32), (torch.float32, torch.float16, torch.float16),
               (torch.float32, torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.bfloat16, torch.bfloat16),
               (torch.float32, torch.float16, torch.float8_e4m3fn), (torch.bfloat16, torch.bfloat16, torch.float8_e5m2)]


@pytest.mark.parametrize("act,weights,kv", LAYER_CASES,
                         ids=["fp32", "fp32-fp16", "fp32-bf16", "bf16", "fp32-fp16-kve4m3", "bf16-kve5m2"])
@pytest.mark.parametrize("name", ["llama_untied_biases", "qwen2"])  # every bias pointer; GQA
def test_fused_decoder_layer_equals_the_layer_op_by_op(native, name, act, weights, kv, monkeypatch):
    # Oracle: the same model running its layers' forward (the native ops one by one, each tested
    # against its reference above). The fused layer composes the same kernels, so the logits must
    # be identical, not just close, at every row count it takes: 1-4, and up to the tier's
    # small_rows_wider (16 on every tier) where the linears' GEMM would multiply an fp32 copy of narrower
    # weights (cpu_linear.PackedLinear.small_rows); one row more must take the layer forward.
    from test_llama_model import CONFIGS, PagedBatch, prompts
    from transformers import AutoModelForCausalLM
    from vbatch.engine.models.registry import get_model_class
    from vbatch.kernels import cpu_native_ops
    from vbatch.kernels.ops import get_ops
    if not native.has_small_linear(act, weights):
        pytest.skip(f"the {native.tier.name} tier has no {act} small-rows kernel: the fused layer is off")
    if not gemm_libraries.can_pack(act):   # e.g. oneDNN held below avx512_bf16 (ONEDNN_MAX_CPU_ISA=AVX2)
        pytest.skip(f"this oneDNN packs no {act} linears: the layers stay unpacked and the fused layer is off")
    config = CONFIGS[name]()
    config.hidden_size, config.intermediate_size, config.head_dim = 256, 160, 64  # as the kernels take it
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in pname else 0.15 * torch.randn_like(p))
    ops = get_ops("cpu", act, weight_dtype=weights, kv_cache_dtype=kv, cpu_tier=native.tier)
    model = get_model_class(config)(config, dtype=act, device="cpu", ops=ops)
    model.load_weights(hf.state_dict().items())
    model.finalize_weights()                                   # as the model runner does: packed linears
    assert ops.decoder_layers.__self__._layer_struct(model.layers[0]) is not None
    calls = []
    real = cpu_native.NativeKernels.decoder_layers
    monkeypatch.setattr(cpu_native.NativeKernels, "decoder_layers",
                        lambda self, *a: calls.append((a[5].shape[0], len(a[0]))) or real(self, *a))
    wider = act == torch.float32 and weights != torch.float32
    most = native.tier.small_rows_wider if wider else 4    # the rows a fused call takes
    assert ops.decoder_layers.__self__._stack(model.layers).max_rows == most
    fused_rows = tuple(sorted({rows for rows in (1, 2, 4, 5, 9, 16) if rows < most} | {most}))
    lens = [most + 1 + 5 * i % 7 for i in range(most + 1)]   # prompts longer than a fused call
    for rows in (*fused_rows, most + 1):
        seqs = prompts(config.vocab_size, lens[:rows], seed=rows)
        runs = {}
        for fused in (True, False):
            monkeypatch.setattr(cpu_native_ops, "FUSED_LAYER_MAX_ROWS", most if fused else 0)
            batch = PagedBatch(model, [len(s) + 3 for s in seqs])
            batch.kv_caches = [(k.to(kv), v.to(kv)) for k, v in batch.kv_caches]
            logits = [batch.step(model, seqs, [0] * rows)]                 # prefill
            for step in range(3):                                          # decode
                tokens = [[int(l.argmax())] for l in logits[-1][-rows:]] if step else [[5]] * rows
                logits.append(batch.step(model, tokens, [len(s) + step for s in seqs]))
            runs[fused] = logits
        for got, want in zip(runs[True], runs[False], strict=True):
            assert torch.equal(got, want), rows
    # fused: the 3 decode steps at each fused row count, every layer in one call (the prefills have
    # more tokens than a fused call takes)
    assert sorted(calls) == [(rows, config.num_hidden_layers) for rows in fused_rows for _ in range(3)]

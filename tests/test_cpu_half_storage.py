"""An fp32 model whose linear weights and KV cache are stored in half precision (dtype auto on
AVX2: fp16; on the portable tier: bf16) against the exact fp32 model, on the real default model.

What changes: each linear weight (q/k/v, o, gate/up, down, the tied logits head) is rounded once to
fp16 (10 mantissa bits: relative error <= 2^-11) or bf16 (7 bits: 2^-8) when the model loads; the
small-rows kernels stream it so and widen it exactly in registers, the large-batch GEMMs use the
same rounded values in fp32 (kernels/cpu_linear.py), so the model is one function at every batch
size. Keys and values are rounded the same way when they are written to the cache (the attention
widens them exactly). Activations, norms, the embedding lookup and every product and sum stay fp32.
Oracle: the same engine with exact fp32 weights, whose greedy tokens test_engine_equality.py proves
identical to transformers'. Contract (measured here when written, docs/performance/avx2-zen3.md "Accuracy
of half-precision storage"), over the 20 prompts of test_cpu_bf16.py:
  - prefill logits: max |half - fp32| over the vocabulary below LOGIT_TOL[storage] for every prompt;
  - greedy: the first token agrees on every prompt (fp16) / >= 95% (bf16), wherever a run first
    departs from fp32's the fp32 model rates the departing token within NEAR_TIE of its own choice
    (a near-tie, not a wrong token), and the common prefix covers >= MIN_PREFIX_SHARE of tokens.
"""
from __future__ import annotations

import pytest
import torch

from test_cpu_bf16 import NEAR_TIE, QUESTIONS, RAW, _prefill_logits, greedy_agreement
from vbatch import LLM

pytestmark = pytest.mark.slow

# measured when written (weights only / weights and KV cache): max |diff| fp16 0.034 / 0.042, bf16
# 0.15 / 0.39; greedy prefixes fp16 100% / 100%, bf16 89.7% / 91.2% (departures at near-ties, fp32
# margins 0.005-0.016)
LOGIT_TOL = {"float16": 0.1, "bfloat16": 0.75}
MIN_PREFIX_SHARE = {"float16": 0.9, "bfloat16": 0.75}
MIN_FIRST_TOKEN_SHARE = {"float16": 1.0, "bfloat16": 0.95}
# (weights, KV cache): the half weights alone, and both (dtype auto on an AVX2 / portable CPU)
STORAGE = {"fp16-weights": ("float16", "float32"), "fp16": ("float16", "float16"),
           "bf16-weights": ("bfloat16", "float32"), "bf16": ("bfloat16", "bfloat16")}
KW = dict(device="cpu", quiet=True, kv_cache_memory="64MiB", max_model_len=512, num_threads=1, dtype="float32")


@pytest.fixture(scope="module")
def exact(smollm2_path):
    return LLM(str(smollm2_path), **KW)


@pytest.fixture(scope="module", params=list(STORAGE))
def half(request, smollm2_path):
    weights, kv = STORAGE[request.param]
    return weights, LLM(str(smollm2_path), weight_dtype=weights, kv_cache_dtype=kv, **KW)


@pytest.fixture(scope="module")
def prompts(exact):
    chats = [exact.preprocess_chat([{"role": "user", "content": q}])["prompt_token_ids"] for q in QUESTIONS]
    return chats + [exact.get_tokenizer().encode(t) for t in RAW]


def test_half_storage_is_what_the_engine_runs(exact, half):
    name, llm = half
    ops = llm.engine.runner.ops
    assert llm.engine.dtype == torch.float32 and ops.weight_dtype == getattr(torch, name)
    assert llm.engine.runner.kv_caches[0][0].dtype == llm.engine.runner.kv_dtype == ops.kv_cache_dtype
    assert exact.engine.runner.ops.weight_dtype == exact.engine.runner.kv_caches[0][0].dtype == torch.float32
    layer = llm.engine.runner.model.layers[0].mlp.gate_up
    if ops.native is not None:   # the small-rows copy is the half-precision one
        assert layer.small_weight.dtype == getattr(torch, name)


def test_half_storage_logits_close_to_fp32(exact, half, prompts):
    name, llm = half
    diffs = [(_prefill_logits(llm, ids) - _prefill_logits(exact, ids)).abs().max().item() for ids in prompts]
    print(f"{name} weights, {llm.engine.runner.kv_dtype} KV vs fp32 prefill logits: max abs diff per prompt, max {max(diffs):.4f}, "
          f"median {sorted(diffs)[len(diffs) // 2]:.4f}")
    assert max(diffs) < LOGIT_TOL[name]


def test_half_storage_greedy_tokens_agree_with_fp32(exact, half, prompts):
    name, llm = half
    share, first, margins = greedy_agreement(exact, llm, prompts, f"{name} weights, {llm.engine.runner.kv_dtype} KV")
    assert share >= MIN_PREFIX_SHARE[name]
    assert first >= MIN_FIRST_TOKEN_SHARE[name]
    assert all(m <= NEAR_TIE for m in margins)


def test_dtype_auto_stores_half_precision_where_bf16_is_slow(smollm2_path):
    # dtype auto: bf16 on an avx512_bf16 tier; elsewhere fp32 arithmetic, weights and KV cache in the
    # tier's half format.
    from vbatch.kernels import cpu_features
    llm = LLM(str(smollm2_path), device="cpu", quiet=True, kv_cache_memory="16MiB", max_model_len=256, num_threads=1)
    tier, ops = cpu_features.selected_tier(), llm.engine.runner.ops
    if llm.engine.dtype == torch.bfloat16:
        assert tier.bf16_compute and ops.weight_dtype == torch.bfloat16
    else:
        want = tier.half_dtype if ops.native is not None else torch.float32
        assert ops.weight_dtype == llm.engine.runner.kv_dtype == want

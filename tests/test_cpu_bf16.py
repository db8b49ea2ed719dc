"""bf16 on CPU (the engine's default here) against fp32 on the real default model.

Oracle: the same engine in fp32, whose greedy tokens test_engine_equality.py proves identical to
transformers'. bf16 cannot be token-identical (weights and activations are rounded to 8 mantissa
bits), so the contract is statistical, over 20 prompts (12 chat questions, 8 raw texts):
  - prefill logits: max |bf16 - fp32| over the vocabulary below LOGIT_TOL for every prompt;
  - greedy tokens: the first token agrees on >= 90% of prompts, and wherever the bf16 greedy run
    first departs from fp32's, the fp32 model itself rates bf16's token within NEAR_TIE of its own
    choice (a near-tie that 8-bit rounding may flip, not a wrong token); the common prefix of the
    first 16 tokens covers >= 75% of all tokens (a floor only: the share is chaotic, see below).
Measured here when written (2 threads, this CPU): see docs/performance/avx512-bf16.md ("bf16 accuracy").
"""
from __future__ import annotations

import pytest
import torch

from test_kernels_reference import make_metadata
from vbatch import LLM, SamplingParams

pytestmark = pytest.mark.slow

NUM_TOKENS = 16
LOGIT_TOL = 1.5          # logits of this model span about +-30; bf16 rounding of 30 layers
# The prefix share moves with any change to bf16 rounding: 92.2% with the reference prefill SDPA,
# 83.4% with its flash path (fp32, 6e-7 apart; logits moved *closer* to fp32: median 0.456 ->
# 0.385), because one flipped near-tie changes the rest of that prompt. The near-tie check is the
# contract; the share is a floor against wholesale breakage.
MIN_PREFIX_SHARE = 0.75
NEAR_TIE = 1.0            # fp32 logit margin between fp32's token and bf16's at the first departure
# The first token: 2 of the 20 prompts may flip (as the q8_0 and fp8 tests allow). With bf16
# activations the avx2 tier (no vdpbf16ps: fp32 FMAs over widened bf16, its prefill attention in
# vb_attention_tiled8.h's micro tiles since dedc2ed) flips two, at fp32 margins of 0.082 and 0.105
# (Zen 3 simulated on Zen 4 held to AVX2, session 29; before dedc2ed one, at 0.082), while its
# prefill logits sit closer to fp32 than before (median max error 0.441 -> 0.402). Every departure,
# the first token's included, must still be a near-tie (NEAR_TIE below).
MIN_FIRST_TOKEN_SHARE = 0.9
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about autumn leaves.",
    "Explain photosynthesis in one sentence.", "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish.", "What is 17 times 23?", "Give me a name for a pet goldfish.",
    "Why is the sky blue?", "Summarise the plot of Romeo and Juliet in two sentences.", "What does a CPU do?",
    "Suggest a healthy breakfast.", "Who wrote 'Pride and Prejudice'?",
]
RAW = [
    "The quick brown fox", "Once upon a time, in a small village by the sea,", "def fibonacci(n):\n    ",
    "The three laws of thermodynamics are", "Paris is", "1, 2, 3, 4,", "In 1969, the first humans",
    "The best way to learn a new language is",
]


@pytest.fixture(scope="module")
def engines(smollm2_path):
    kw = dict(device="cpu", quiet=True, kv_cache_memory="64MiB", max_model_len=512, num_threads=1)
    return LLM(str(smollm2_path), dtype="float32", **kw), LLM(str(smollm2_path), dtype="bfloat16", **kw)


@pytest.fixture(scope="module")
def prompts(engines):
    llm = engines[0]
    chats = [llm.preprocess_chat([{"role": "user", "content": q}])["prompt_token_ids"] for q in QUESTIONS]
    return chats + [llm.get_tokenizer().encode(t) for t in RAW]


def _prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:  # [vocab] fp32, next-token logits
    runner = llm.engine.runner
    model = runner.model
    import random
    attn = make_metadata([0], [len(ids)], runner.block_size, runner.num_blocks - 1, random.Random(0))
    caches = [tuple(torch.zeros_like(c) for c in kv) for kv in runner.kv_caches]
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), caches, attn)
        return model.compute_logits(hidden[-1:])[0]


def test_bf16_logits_close_to_fp32(engines, prompts):
    fp32, bf16 = engines
    assert bf16.engine.dtype == torch.bfloat16
    diffs = []
    for ids in prompts:
        want, got = _prefill_logits(fp32, ids), _prefill_logits(bf16, ids)
        diffs.append((got - want).abs().max().item())
    print(f"bf16 vs fp32 prefill logits: max abs diff per prompt, max {max(diffs):.3f}, "
          f"median {sorted(diffs)[len(diffs) // 2]:.3f}")
    assert max(diffs) < LOGIT_TOL


def greedy_agreement(fp32: LLM, other: LLM, prompts, label: str) -> tuple[float, float, list[float]]:
    """(share of tokens in the common greedy prefix, share of prompts whose first token agrees, the fp32
    logit margins between fp32's token and `other`'s at each first departure); prints them."""
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    want = [o.outputs[0].token_ids for o in fp32.generate(batch, params)]
    got = [o.outputs[0].token_ids for o in other.generate(batch, params)]
    prefix = []
    for a, b in zip(want, got):
        n = 0
        while n < NUM_TOKENS and a[n] == b[n]:
            n += 1
        prefix.append(n)
    share = sum(prefix) / (NUM_TOKENS * len(prompts))
    first = sum(p > 0 for p in prefix) / len(prompts)
    margins = []
    for ids, a, b, n in zip(prompts, want, got, prefix):
        if n < NUM_TOKENS:
            logits = _prefill_logits(fp32, list(ids) + list(a[:n]))
            margins.append((logits[a[n]] - logits[b[n]]).item())
    print(f"{label} vs fp32 greedy: common prefix covers {share:.1%} of tokens, first token agrees on {first:.0%}; "
          f"per prompt {prefix}; fp32 margins at the first departures: {[round(m, 3) for m in margins]}")
    return share, first, margins


def test_bf16_greedy_tokens_mostly_agree_with_fp32(engines, prompts):
    fp32, bf16 = engines
    share, first, margins = greedy_agreement(fp32, bf16, prompts, "bf16")
    assert share >= MIN_PREFIX_SHARE
    assert first >= MIN_FIRST_TOKEN_SHARE
    assert all(m <= NEAR_TIE for m in margins)

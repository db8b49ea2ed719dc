"""The engine against Hugging Face transformers on the real default model (fp32, greedy).

Oracle: transformers' own LlamaForCausalLM on the same converted weights, one prompt at a
time with `generate(do_sample=False)`. Our engine must produce the same tokens for every
prompt whatever the batch size, chunking, prefix caching or preemption.
"""
from __future__ import annotations

import os

import pytest
import torch

from vbatch import LLM, SamplingParams
from vbatch.kernels.cpu_features import detect
from vbatch.kernels.gemm_libraries import gemm_backend

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
LOWER_TIERS = [t.name for t in detect().tiers[1:]]  # the tiers below this CPU's best
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish.",
    "What is 17 times 23?",
    "Give me a name for a pet goldfish.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What does a CPU do?",
    "Suggest a healthy breakfast.",
    "Who wrote 'Pride and Prejudice'?",
]
RAW = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "The three laws of thermodynamics are",
    "Paris is",
    "1, 2, 3, 4,",
    "In 1969, the first humans",
    "A" * 3 + " long prompt that repeats itself. " * 12,
]


@pytest.fixture(scope="module")
def prompts(smollm2_path):
    from vbatch.engine.tokenizer import apply_chat_template, load_tokenizer
    tok = load_tokenizer(smollm2_path)
    chats = [apply_chat_template(tok, [{"role": "user", "content": q}], chat_template=None,
                                 add_generation_prompt=True, continue_final_message=False) for q in QUESTIONS]
    ids = [tok.encode(p, add_special_tokens=False) for p in chats] + [tok.encode(p) for p in RAW]
    assert len(ids) >= 20
    return ids


def hf_greedy_tokens(model, prompts, max_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate` of each prompt alone (no padding), stopping at its EOS."""
    eos = model.generation_config.eos_token_id
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                               eos_token_id=eos, pad_token_id=eos if isinstance(eos, int) else eos[0])
            outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def hf_greedy(smollm2_path, prompts):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    return hf_greedy_tokens(model, prompts, MAX_TOKENS)


def _run(smollm2_path, prompts, **engine_kwargs):
    llm = LLM(str(smollm2_path), dtype="float32", device="cpu", quiet=True, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return llm, [o.outputs[0].token_ids for o in outs]


CASES = {
    "batch20": dict(max_num_seqs=20),
    "batch1": dict(max_num_seqs=1),
    "chunked_small_budget": dict(max_num_seqs=20, max_num_batched_tokens=24),
    "no_chunked_prefill": dict(max_num_seqs=20, enable_chunked_prefill=False, max_model_len=512),
    "no_prefix_caching": dict(max_num_seqs=20, enable_prefix_caching=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(smollm2_path, prompts, hf_greedy, case):
    _, ours = _run(smollm2_path, prompts, **CASES[case])
    mismatches = [i for i, (a, b) in enumerate(zip(ours, hf_greedy)) if a != b]
    assert not mismatches, f"{case}: prompts {mismatches} differ, e.g. ours {ours[mismatches[0]]} vs hf {hf_greedy[mismatches[0]]}"


@pytest.mark.parametrize("tier", LOWER_TIERS)
def test_greedy_matches_transformers_on_every_lower_cpu_tier(smollm2_path, prompts, hf_greedy, tier, monkeypatch):
    # The cases above run the CPU's best tier; each lower tier this CPU runs (forced as a user would,
    # VBATCH_CPU_TIER) must give the same tokens: the portable tier is what ARM machines get.
    monkeypatch.setenv("VBATCH_CPU_TIER", tier)
    llm, ours = _run(smollm2_path, prompts, max_num_seqs=20)
    assert llm.engine.runner.ops.cpu_tier.name == tier and llm.engine.runner.ops.native is not None
    # where the tier's fp32 GEMM is vbatch's own (avx2), the prompts' MLPs ran through its gated GEMM
    gate_up = llm.engine.runner.model.layers[0].mlp.gate_up
    ops = llm.engine.runner.ops
    gated = llm.engine.dtype == torch.float32 and gemm_backend(torch.float32, ops.cpu_tier).gated is not None
    assert gated == (tier == "avx2" and not os.environ.get("VBATCH_GEMM"))
    assert getattr(gate_up, "one_gemm", False) == gated
    mismatches = [i for i, (a, b) in enumerate(zip(ours, hf_greedy)) if a != b]
    assert not mismatches, f"{tier}: prompts {mismatches} differ"


def test_greedy_matches_transformers_without_huge_pages(smollm2_path, prompts, hf_greedy, monkeypatch):
    # The cases above run with the weights and KV cache on huge pages where the OS has them
    # (kernels/cpu_huge_pages.py); VBATCH_HUGE_PAGES=0 leaves them where loading put them.
    monkeypatch.setenv("VBATCH_HUGE_PAGES", "0")
    llm, ours = _run(smollm2_path, prompts, max_num_seqs=20)
    assert not llm.engine.runner.huge_pages
    mismatches = [i for i, (a, b) in enumerate(zip(ours, hf_greedy)) if a != b]
    assert not mismatches, f"without huge pages: prompts {mismatches} differ"


def test_greedy_matches_under_preemption(smollm2_path, prompts, hf_greedy):
    # 16 usable blocks of 16 tokens (one max_model_len sequence) for 20 sequences of up to
    # ~175 tokens: the scheduler must preempt and recompute.
    llm, ours = _run(smollm2_path, prompts, max_num_seqs=20, num_gpu_blocks_override=17, max_model_len=256)
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert ours == hf_greedy


def test_prefix_cache_hits_are_reported(smollm2_path, prompts, hf_greedy):
    llm = LLM(str(smollm2_path), dtype="float32", device="cpu", quiet=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params)[0]
    second = llm.generate([{"prompt_token_ids": prompts[0]}], params)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(prompts[0]) - 1) // 16 * 16 > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids == hf_greedy[0]


def test_kv_cache_smaller_than_one_sequence_is_refused(smollm2_path):
    from vbatch.engine.errors import ConfigError
    with pytest.raises(ConfigError, match="kv_cache_memory.*max_model_len=256"):
        LLM(str(smollm2_path), dtype="float32", device="cpu", quiet=True, num_gpu_blocks_override=9, max_model_len=256)


@pytest.mark.parametrize("tier", [None, *LOWER_TIERS], ids=["best", *LOWER_TIERS])
def test_greedy_matches_transformers_in_multi_step_decodes(smollm2_path, prompts, hf_greedy, tier, monkeypatch):
    # One to four requests at a time, nobody waiting: the scheduler asks for up to 8 forwards a step,
    # and the model samples and feeds back its own tokens in one native call (engine/scheduler.py).
    if tier is not None:
        monkeypatch.setenv("VBATCH_CPU_TIER", tier)
    llm = LLM(str(smollm2_path), dtype="float32", device="cpu", quiet=True, max_num_seqs=4)
    engine = llm.engine
    if engine.scheduler.decode_steps_rows == 0:
        pytest.skip("no native kernels on this machine (the multi-step decode is native only)")
    assert engine.scheduler.num_decode_steps == 8
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    ours, start, before = [], 0, engine.stats.num_steps
    for size in (1, 2, 3, 4) * 4:
        group = prompts[start:start + size]
        ours += [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in group], params)]
        start += size
        if start >= len(prompts):
            break
    assert engine.stats.num_steps - before < sum(map(len, ours)) / 4, "the decodes ran one step at a time"
    mismatches = [i for i, (a, b) in enumerate(zip(ours, hf_greedy)) if a != b]
    assert len(ours) == len(prompts) and not mismatches, f"prompts {mismatches} differ"

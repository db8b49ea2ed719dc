"""The Llama-family model on the paged KV cache against transformers as the oracle.

Small random-weight fp32 configs (GQA Llama tied/untied, Qwen2 with q/k/v bias, llama3 and linear
rope scaling, Mistral with an explicit head_dim); weights are re-drawn larger than transformers'
init so logits are O(1) and differences mean something. Each case runs a batch of sequences through
our model with random, shuffled block tables and compares logits per sequence with transformers'
full-sequence forward: (1) one prefill, (2) prefill in two chunks (the second with context_lens > 0,
one request's second chunk a single token), (3) prefill then decode steps feeding the argmax token.
Tolerance: 1e-4 absolute on fp32 logits (measured: about 1e-6).
"""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from vbatch.engine.errors import ModelLoadError, UnsupportedModelError
from vbatch.engine.models.registry import SUPPORTED_ARCHITECTURES, get_model_class
from vbatch.kernels.attention_metadata import AttentionMetadata

torch.set_num_threads(1)

BLOCK_SIZE = 4
LOGIT_TOL = 1e-4
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}

CONFIGS = {
    "llama_gqa_tied": lambda: LlamaConfig(**SMALL, tie_word_embeddings=True),
    "llama_untied_biases": lambda: LlamaConfig(**SMALL, tie_word_embeddings=False,
                                               attention_bias=True, mlp_bias=True),
    "qwen2": lambda: Qwen2Config(**SMALL, tie_word_embeddings=False),
    "llama3_rope": lambda: LlamaConfig(**SMALL, rope_parameters=LLAMA3_ROPE),
    "linear_rope": lambda: LlamaConfig(**SMALL, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                 "rope_theta": 10000.0}),
    "mistral_head_dim": lambda: MistralConfig(**SMALL, head_dim=32, sliding_window=None),
}


def build_pair(name: str):
    """(transformers model, our model loaded from its state_dict), same random weights."""
    config = CONFIGS[name]()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    ours = get_model_class(config)(config, dtype=torch.float32, device=torch.device("cpu"))
    ours.load_weights(hf.state_dict().items())
    return hf, ours


class PagedBatch:
    """A fixed set of sequences with shuffled, non-contiguous block tables and a KV cache."""

    def __init__(self, model, max_lens: list[int], seed: int = 0) -> None:
        rng = random.Random(seed)
        blocks_per_req = [-(-n // BLOCK_SIZE) for n in max_lens]
        self.num_blocks = sum(blocks_per_req) + 3
        free = list(range(self.num_blocks))
        rng.shuffle(free)
        self.tables = [[free.pop() for _ in range(n)] for n in blocks_per_req]
        shape = model.kv_cache_shape(self.num_blocks, BLOCK_SIZE)
        # NaN in never-written slots: the model must never read them.
        self.kv_caches = [(torch.full(shape, float("nan")), torch.full(shape, float("nan")))
                          for _ in range(model.num_layers)]

    def step(self, model, chunks: list[list[int]], context_lens: list[int]) -> torch.Tensor:
        """Run one step: request r feeds tokens chunks[r] at positions context_lens[r]...; -> logits [T, V]."""
        query_lens = [len(c) for c in chunks]
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        positions, slots = [], []
        for r, (ctx, seq) in enumerate(zip(context_lens, seq_lens)):
            for p in range(ctx, seq):
                positions.append(p)
                slots.append(self.tables[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        width = max(len(t) for t in self.tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            context_lens=torch.tensor(context_lens, dtype=torch.int32),
            block_tables=block_tables, block_size=BLOCK_SIZE,
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_lens_list=tuple(query_lens), seq_lens_list=tuple(seq_lens))
        input_ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64)
        with torch.no_grad():
            hidden = model(input_ids, torch.tensor(positions, dtype=torch.int64), self.kv_caches, attn)
            return model.compute_logits(hidden)


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:  # [len(tokens), V]
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = (got - want).abs().max().item()
    assert diff < LOGIT_TOL, f"{what}: max abs logit diff {diff:.3e} (tolerance {LOGIT_TOL})"


def prompts(vocab: int, lens: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_and_chunked_prefill_match_transformers(name):
    hf, ours = build_pair(name)
    seqs = prompts(hf.config.vocab_size, [5, 11, 3])
    want = [hf_logits(hf, s) for s in seqs]
    # (1) one full prefill
    batch = PagedBatch(ours, [len(s) for s in seqs])
    logits = batch.step(ours, seqs, [0, 0, 0])
    start = 0
    for r, s in enumerate(seqs):
        assert_close(logits[start:start + len(s)], want[r], f"{name} prefill req {r}")
        start += len(s)
    # (2) two chunks; request 2's second chunk is a single token (the decode path)
    first = [3, 6, 2]
    batch = PagedBatch(ours, [len(s) for s in seqs], seed=5)
    logits1 = batch.step(ours, [s[:n] for s, n in zip(seqs, first)], [0, 0, 0])
    logits2 = batch.step(ours, [s[n:] for s, n in zip(seqs, first)], first)
    start1 = start2 = 0
    for r, (s, n) in enumerate(zip(seqs, first)):
        assert_close(logits1[start1:start1 + n], want[r][:n], f"{name} chunk 1 req {r}")
        assert_close(logits2[start2:start2 + len(s) - n], want[r][n:], f"{name} chunk 2 req {r}")
        start1 += n
        start2 += len(s) - n


@pytest.mark.parametrize("name", ["llama_gqa_tied", "qwen2", "llama3_rope"])
def test_prefill_then_greedy_decode_matches_transformers(name):
    hf, ours = build_pair(name)
    num_steps = 6
    seqs = prompts(hf.config.vocab_size, [7, 2, 13], seed=2)
    batch = PagedBatch(ours, [len(s) + num_steps for s in seqs], seed=9)
    logits = batch.step(ours, seqs, [0, 0, 0])
    last = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1
    step_logits = logits[last]  # [num_reqs, V]: each request's next-token logits
    for step in range(num_steps):
        for r, s in enumerate(seqs):
            assert_close(step_logits[r], hf_logits(hf, s)[-1], f"{name} decode step {step} req {r}")
        next_tokens = step_logits.argmax(-1).tolist()
        context = [len(s) for s in seqs]
        for s, t in zip(seqs, next_tokens):
            s.append(t)
        step_logits = batch.step(ours, [[t] for t in next_tokens], context)


def test_bf16_model_close_to_fp32_transformers():
    # bf16 weights/activations: compared with the fp32 oracle; transformers' own bf16 run of the
    # same weights is about 0.1 off it here, so 0.3 leaves room without hiding a real bug (O(1)).
    hf, _ = build_pair("qwen2")
    ours = get_model_class(hf.config)(hf.config, dtype=torch.bfloat16, device="cpu")
    ours.load_weights(hf.state_dict().items())
    seqs = prompts(hf.config.vocab_size, [5, 9], seed=3)
    batch = PagedBatch(ours, [len(s) + 1 for s in seqs])
    batch.kv_caches = [(k.bfloat16(), v.bfloat16()) for k, v in batch.kv_caches]
    logits = batch.step(ours, seqs, [0, 0])
    assert logits.dtype == torch.float32
    want = torch.cat([hf_logits(hf, s) for s in seqs])
    diff = (logits - want).abs().max().item()
    assert diff < 0.3, f"bf16 vs fp32 oracle: max abs logit diff {diff:.3e}"


def test_get_model_class_lists_supported_architectures():
    config = LlamaConfig(**SMALL)
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(UnsupportedModelError) as info:
        get_model_class(config)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)
    config.architectures = ["Qwen2ForCausalLM"]
    assert get_model_class(config) is SUPPORTED_ARCHITECTURES["Qwen2ForCausalLM"]
    assert get_model_class(LlamaConfig(**SMALL)) is SUPPORTED_ARCHITECTURES["LlamaForCausalLM"]


def test_sliding_window_and_unknown_rope_are_refused():
    mistral = MistralConfig(**SMALL, sliding_window=16)
    with pytest.raises(UnsupportedModelError, match="sliding"):
        get_model_class(mistral)(mistral, dtype=torch.float32, device="cpu")
    # A window at least as long as every sequence is plain causal attention.
    get_model_class(mistral)(mistral, dtype=torch.float32, device="cpu", max_model_len=16)
    yarn = LlamaConfig(**SMALL, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                 "original_max_position_embeddings": 16})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        get_model_class(yarn)(yarn, dtype=torch.float32, device="cpu")


def test_load_weights_names_missing_unexpected_and_misshapen_tensors():
    hf, ours = build_pair("llama_untied_biases")
    state = dict(hf.state_dict())
    missing = {k: v for k, v in state.items() if k != "model.layers.2.mlp.up_proj.weight"}
    with pytest.raises(ModelLoadError, match=r"missing.*model\.layers\.2\.mlp\.up_proj\.weight"):
        ours.load_weights(missing.items())
    extra = {**state, "model.layers.0.self_attn.rogue.weight": torch.zeros(3)}
    with pytest.raises(ModelLoadError, match=r"unexpected.*model\.layers\.0\.self_attn\.rogue\.weight"):
        ours.load_weights(extra.items())
    misshapen = {**state, "model.layers.1.self_attn.k_proj.weight": torch.zeros(5, 64)}
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*\(5, 64\)"):
        ours.load_weights(misshapen.items())
    ours.load_weights(list(state.items()) + [("model.rotary_emb.inv_freq", torch.zeros(8))])

"""Sampler, SamplingMetadata and logits processors against hand-computed small-vocab cases.

Oracles: probabilities written out by hand (logits = log p), torch.log_softmax for logprobs,
and the same row sampled alone for batch invariance.
"""
from __future__ import annotations

import math

import pytest
import torch

from vbatch.engine.request import Request
from vbatch.engine.logits_processors import apply_top_k_top_p
from vbatch.engine.sampler import Sampler, SamplerOutput, apply_logits_processors, compute_prompt_logprobs
from vbatch.engine.sampling_metadata import SamplingMetadata
from vbatch.engine.sampling_params import SamplingParams

torch.set_num_threads(1)

CPU = torch.device("cpu")
EOS = 0


def make_request(rid="r", prompt=(1, 2, 3), output=(), vocab=10, eos=(EOS,), **params) -> Request:
    sp = SamplingParams(**params).resolve(eos_token_ids=list(eos), vocab_size=vocab)
    req = Request(request_id=str(rid), prompt_token_ids=list(prompt), sampling_params=sp, max_tokens=100)
    for t in output:
        req.append_output_token(t)
    return req


def build(reqs, vocab=10) -> SamplingMetadata:
    return SamplingMetadata.build(reqs, vocab_size=vocab, device=CPU)


def sample(reqs, logits, seed=0, vocab=None, native=None) -> SamplerOutput:
    meta = build(reqs, vocab or logits.shape[1])
    return Sampler(native=native)(logits, meta, torch.Generator().manual_seed(seed))


def processed(reqs, logits) -> torch.Tensor:
    out = logits.clone()
    apply_logits_processors(out, build(reqs, logits.shape[1]))
    return out


def frequencies(probs: list[float], num: int = 4000, seed: int = 0, **params) -> torch.Tensor:
    """Sample `num` identical unseeded rows whose logits are log(probs); return token frequencies."""
    vocab = len(probs)
    logits = torch.tensor(probs, dtype=torch.float32).log().expand(num, vocab).contiguous()
    reqs = [make_request(i, vocab=vocab, **params) for i in range(num)]
    tokens = sample(reqs, logits, seed=seed).sampled_token_ids
    return torch.bincount(tokens, minlength=vocab).float() / num


def assert_freqs(freqs: torch.Tensor, expected: list[float], tol: float = 0.03) -> None:
    expected_t = torch.tensor(expected)
    # Tokens with probability 0 must never appear; the others within ~4 sigma at n=4000.
    assert torch.all(freqs[expected_t == 0] == 0), freqs
    assert torch.allclose(freqs, expected_t, atol=tol), (freqs, expected_t)


# ------------------------------------------------------------------ greedy and temperature
def test_greedy_is_argmax_and_ignores_the_generator():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 0.0]])
    reqs = [make_request(0, vocab=4, temperature=0.0), make_request(1, vocab=4, temperature=0.0)]
    for seed in range(3):
        assert sample(reqs, logits, seed=seed).sampled_token_ids.tolist() == [1, 0]


def test_temperature_one_matches_the_probabilities():
    probs = [0.1, 0.2, 0.3, 0.4]
    assert_freqs(frequencies(probs), probs)


def test_temperature_sharpens_and_flattens():
    probs = [0.1, 0.2, 0.3, 0.4]
    for temp in (0.5, 2.0):
        powered = [p ** (1 / temp) for p in probs]
        expected = [p / sum(powered) for p in powered]
        assert_freqs(frequencies(probs, temperature=temp), expected)


# ------------------------------------------------------------------ truncation filters
def test_top_k_keeps_exactly_k_tokens():
    probs = [0.1, 0.35, 0.05, 0.3, 0.2]
    freqs = frequencies(probs, top_k=2)
    assert_freqs(freqs, [0, 0.35 / 0.65, 0, 0.3 / 0.65, 0])


def test_top_p_keeps_smallest_set_reaching_p():
    probs = [0.05, 0.1, 0.15, 0.3, 0.4]
    # {0.4} = 0.4 < 0.65, {0.4, 0.3} = 0.7 >= 0.65
    assert_freqs(frequencies(probs, top_p=0.65), [0, 0, 0, 0.3 / 0.7, 0.4 / 0.7])
    # {0.4, 0.3} = 0.7 < 0.75, add 0.15 -> 0.85
    assert_freqs(frequencies(probs, top_p=0.75), [0, 0, 0.15 / 0.85, 0.3 / 0.85, 0.4 / 0.85])


def test_top_p_always_keeps_the_top_token():
    # 1 - 1e-9 rounds to 1.0 in float32: without the guard every token would be dropped.
    freqs = frequencies([0.1, 0.2, 0.7], num=500, top_p=1e-9)
    assert freqs.tolist() == [0.0, 0.0, 1.0]


def test_min_p_drops_tokens_below_fraction_of_top():
    probs = [0.5, 0.3, 0.1, 0.06, 0.04]
    # threshold 0.15 * 0.5 = 0.075: keep 0.5, 0.3, 0.1
    assert_freqs(frequencies(probs, min_p=0.15), [0.5 / 0.9, 0.3 / 0.9, 0.1 / 0.9, 0, 0])


def test_min_p_applies_after_temperature():
    probs = [0.5, 0.3, 0.1, 0.06, 0.04]
    # temperature 2: p ~ sqrt(p) = [.351, .272, .157, .122, .099]; min_p 0.4 -> threshold .140.
    # (Before temperature the threshold would be 0.2 and only two tokens would survive.)
    roots = [math.sqrt(p) for p in probs]
    kept = roots[:3]
    expected = [r / sum(kept) for r in kept] + [0, 0]
    assert_freqs(frequencies(probs, temperature=2.0, min_p=0.4), expected)


def test_top_k_and_top_p_together_in_one_batch():
    probs = [0.05, 0.1, 0.15, 0.3, 0.4]
    vocab = len(probs)
    num = 3000
    logits = torch.tensor(probs).log().expand(2 * num, vocab).contiguous()
    reqs = [make_request(i, vocab=vocab, top_k=3) for i in range(num)]
    reqs += [make_request(i, vocab=vocab, top_p=0.65) for i in range(num, 2 * num)]
    tokens = sample(reqs, logits).sampled_token_ids
    f_k = torch.bincount(tokens[:num], minlength=vocab).float() / num
    f_p = torch.bincount(tokens[num:], minlength=vocab).float() / num
    assert_freqs(f_k, [0, 0, 0.15 / 0.85, 0.3 / 0.85, 0.4 / 0.85])
    assert_freqs(f_p, [0, 0, 0, 0.3 / 0.7, 0.4 / 0.7])


def naive_kept(row: list[float], k: int, p: float) -> set[int]:
    """Per-row oracle: the k best tokens, then the best-first prefix whose renormalised mass reaches p."""
    order = sorted(range(len(row)), key=lambda t: -row[t])[:k]
    weights = [math.exp(row[t] - row[order[0]]) for t in order]
    total = sum(weights)
    kept, mass = set(), 0.0
    for t, w in zip(order, weights):
        kept.add(t)
        mass += w / total
        if mass >= p:
            break
    return kept


@pytest.mark.parametrize("scale", [4.0, 0.05])   # peaked (top-256 holds p) and flat (full sort fallback)
def test_top_k_top_p_against_naive_oracle(scale):
    vocab = 2048   # large enough for the topk candidate paths (k * 4 <= vocab)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, vocab, generator=gen, dtype=torch.float64).float() * scale
    settings = [  # (top_k per row or None, top_p per row or None)
        ([5, 40, 100, 2, 17, 60], None),
        (None, [0.5, 0.9, 0.95, 0.3, 0.97, 0.7]),
        ([5, 40, 100, 2, 17, 60], [0.5, 0.9, 0.95, 0.3, 0.97, 0.7]),
        ([vocab, 40, vocab, 700, 17, vocab], [0.5, 1.0, 0.95, 0.3, 1.0, 0.7]),   # mixed: full sort
    ]
    for ks, ps in settings:
        out = logits.clone()
        top_k = torch.tensor(ks) if ks is not None else None
        top_p = torch.tensor(ps, dtype=torch.float32) if ps is not None else None
        apply_top_k_top_p(out, top_k, top_p, max(ks) if ks is not None else vocab)
        for r in range(6):
            kept = set(torch.nonzero(torch.isfinite(out[r])).flatten().tolist())
            expected = naive_kept(logits[r].tolist(), ks[r] if ks else vocab, ps[r] if ps else 1.0)
            assert kept == expected, (ks, ps, r, len(kept), len(expected))
            assert torch.equal(out[r, sorted(kept)], logits[r, sorted(kept)])


# ------------------------------------------------------------------ logits processors
def test_penalties_match_hand_computation():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, -2.0, 3.0]])
    # prompt has 1 and 4; output has 2 once and 3 twice
    req = make_request(prompt=[1, 4], output=[3, 2, 3], vocab=6, repetition_penalty=2.0,
                       frequency_penalty=0.5, presence_penalty=0.25, eos=(5,))
    expected = torch.tensor([[
        1.0,                       # unseen
        2.0 / 2,                   # prompt, positive: divided
        -1.0 * 2 - 0.5 * 1 - 0.25,  # output once, negative: multiplied, then freq + presence
        0.5 / 2 - 0.5 * 2 - 0.25,  # output twice
        -2.0 * 2,                  # prompt, negative
        3.0,                       # unseen
    ]])
    assert torch.allclose(processed([req], logits), expected)


def test_penalty_rows_do_not_touch_other_rows():
    logits = torch.randn(2, 6)
    reqs = [make_request(0, prompt=[1, 2], output=[3], vocab=6, repetition_penalty=1.5,
                         frequency_penalty=1.0, eos=(5,)),
            make_request(1, prompt=[1, 2], output=[3], vocab=6, eos=(5,))]
    out = processed(reqs, logits)
    assert torch.equal(out[1], logits[1])
    assert not torch.equal(out[0], logits[0])


def test_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[0.0, 1.0, 0.9, 0.0]])
    req = make_request(prompt=[2], output=[1, 1], vocab=4, temperature=0.0, frequency_penalty=0.2)
    assert sample([req], logits).sampled_token_ids.tolist() == [2]


def test_logit_bias_is_added():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]])
    reqs = [make_request(0, vocab=4, logit_bias={0: 5.0, 3: -1.5}), make_request(1, vocab=4)]
    expected = logits.clone()
    expected[0, 0] += 5.0
    expected[0, 3] -= 1.5
    assert torch.equal(processed(reqs, logits), expected)
    greedy = [make_request(0, vocab=4, temperature=0.0, logit_bias={0: 5.0})]
    assert sample(greedy, logits[:1]).sampled_token_ids.tolist() == [0]


def test_allowed_token_ids_mask_everything_else():
    logits = torch.zeros(2, 6)
    reqs = [make_request(0, vocab=6, allowed_token_ids=[1, 4]), make_request(1, vocab=6)]
    out = processed(reqs, logits)
    inf = float("-inf")
    assert out[0].tolist() == [inf, 0.0, inf, inf, 0.0, inf]
    assert out[1].tolist() == [0.0] * 6
    freqs = frequencies([1 / 6] * 6, num=1000, allowed_token_ids=[1, 4])
    assert set(torch.nonzero(freqs).flatten().tolist()) == {1, 4}


def _with_bad_words(req: Request, words: tuple[tuple[int, ...], ...]) -> Request:
    # bad_words_token_ids comes from a tokenizer in resolve(); set it directly here.
    req.sampling_params = req.sampling_params.replace(bad_words=["x"], bad_words_token_ids=words)
    return req


def test_bad_words_single_token_always_banned_multi_token_after_prefix():
    words = ((7,), (3, 4), (1, 2, 5))
    logits = torch.zeros(1, 10)
    cases = [
        ([], {7}),                 # nothing generated: only the single-token word
        ([9, 3], {7, 4}),          # ends with the prefix (3,) of (3, 4)
        ([3, 9], {7}),             # 3 not at the end any more
        ([1, 2], {7, 5}),          # ends with (1, 2) of (1, 2, 5)
        ([2], {7}),                # partial prefix is not enough
        ([1, 2, 3], {7, 4}),
    ]
    for output, banned in cases:
        req = _with_bad_words(make_request(output=output, prompt=[1, 2]), words)
        out = processed([req], logits)[0]
        got = set(torch.nonzero(out == float("-inf")).flatten().tolist())
        assert got == banned, (output, got)


def test_bad_words_look_at_the_output_not_the_prompt():
    req = _with_bad_words(make_request(prompt=[3], output=[]), ((3, 4),))
    assert torch.isfinite(processed([req], torch.zeros(1, 10))).all()


def test_min_tokens_masks_stop_ids_until_reached():
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 10.0
    logits[0, 6] = 9.0
    for num_out, masked in ((0, True), (2, True), (3, False)):
        req = make_request(output=[1] * num_out, min_tokens=3, stop_token_ids=[6], temperature=0.0)
        out = processed([req], logits)[0]
        assert (out[EOS] == float("-inf")).item() is masked
        assert (out[6] == float("-inf")).item() is masked
        assert torch.isfinite(out[1:6]).all()
        assert sample([req], logits).sampled_token_ids.item() == (1 if masked else EOS)


def test_min_tokens_with_ignore_eos_masks_only_stop_ids():
    req = make_request(min_tokens=2, stop_token_ids=[6], ignore_eos=True)
    out = processed([req], torch.zeros(1, 10))[0]
    assert torch.isfinite(out[EOS]) and out[6] == float("-inf")


# ------------------------------------------------------------------ logprobs
def test_sample_logprobs_are_raw_log_softmax_with_ranks():
    torch.manual_seed(0)
    logits = torch.randn(3, 12)
    reqs = [make_request(0, vocab=12, temperature=0.0, logprobs=3, logit_bias={5: 50.0}),
            make_request(1, vocab=12, logprobs=0, seed=3),
            make_request(2, vocab=12)]
    out = sample(reqs, logits)
    ref = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    sampled = out.sampled_token_ids.tolist()
    assert sampled[0] == 5                                  # bias decides the token ...
    for i, k in ((0, 3), (1, 0)):
        lp = out.logprobs[i]
        tok = sampled[i]
        assert len(lp.token_ids) == len(lp.logprobs) == len(lp.ranks) == 1
        assert lp.token_ids[0][0] == tok
        # ... but the logprobs are the raw model's (vLLM's raw_logprobs mode).
        assert lp.logprobs[0][0] == pytest.approx(ref[i, tok].item(), abs=1e-6)
        order = torch.argsort(ref[i], descending=True).tolist()
        assert lp.ranks[0] == order.index(tok) + 1
        assert lp.token_ids[0][1:] == order[:k]
        assert lp.logprobs[0][1:] == pytest.approx(ref[i, order[:k]].tolist(), abs=1e-6)


def test_logprobs_k_larger_than_vocab_is_clamped():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    lp = sample([make_request(vocab=3, temperature=0.0, logprobs=20, eos=(1,))], logits).logprobs[0]
    assert lp.token_ids[0] == [2, 2, 1, 0] and lp.ranks == [1]


def test_prompt_logprobs():
    torch.manual_seed(1)
    logits = torch.randn(4, 9)
    targets = torch.tensor([3, 0, 8, 3])
    lp = compute_prompt_logprobs(logits, targets, k=2)
    ref = torch.log_softmax(logits, dim=-1)
    assert len(lp.token_ids) == len(lp.logprobs) == len(lp.ranks) == 4
    for pos in range(4):
        t = targets[pos].item()
        order = torch.argsort(ref[pos], descending=True).tolist()
        assert lp.token_ids[pos] == [t] + order[:2]
        assert lp.logprobs[pos] == pytest.approx([ref[pos, t].item()] + ref[pos, order[:2]].tolist(), abs=1e-6)
        assert lp.ranks[pos] == order.index(t) + 1
    lp0 = compute_prompt_logprobs(logits, targets, k=0)
    assert lp0.token_ids == [[t] for t in targets.tolist()]


# ------------------------------------------------------------------ seeds and batch invariance
VOCAB = 32
_MARKOV = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(42)) * 2


def next_logits(req: Request) -> torch.Tensor:
    """A tiny 'model': the next logits depend only on the request's last token."""
    last = req.all_token_ids[-1]
    return _MARKOV[last]


def run_steps(groups: list[list[Request]], num_steps: int, default_seed: int = 99) -> None:
    """Run num_steps; each step samples `groups[step % len(groups)]` (different batches each step)."""
    sampler = Sampler()
    default = torch.Generator().manual_seed(default_seed)
    table: dict = {}   # the runner's per-request generators, for this run
    for step in range(num_steps):
        batch = groups[step % len(groups)]
        logits = torch.stack([next_logits(r) for r in batch])
        meta = SamplingMetadata.build(batch, vocab_size=VOCAB, device=CPU, generators_by_id=table)
        for r, t in zip(batch, sampler(logits, meta, default).sampled_token_ids.tolist()):
            r.append_output_token(t)


def seeded(rid, seed, **params):
    return make_request(rid, prompt=[1], vocab=VOCAB, seed=seed, top_k=20, top_p=0.95, **params)


def test_same_seed_same_tokens_whatever_the_batch():
    num_steps = 30
    alone = seeded("alone", 1234)
    run_steps([[alone]], num_steps)

    # Same request in batches of different size and order, changing every step.
    target = seeded("t", 1234)
    others = [seeded(f"s{i}", 7 + i) for i in range(3)] + [make_request(f"u{i}", prompt=[1], vocab=VOCAB)
                                                           for i in range(3)]
    groups = [[target] + others[:2], others[3:] + [target], [others[5], target, others[0], others[4]]]
    run_steps(groups, num_steps * 3)   # target is in every group: num_steps*3 tokens for it
    assert target.output_token_ids[:num_steps] == alone.output_token_ids

    # And with another default generator seed.
    target2 = seeded("t2", 1234)
    run_steps([[make_request("x", prompt=[1], vocab=VOCAB), target2]], num_steps, default_seed=5)
    assert target2.output_token_ids == alone.output_token_ids


def test_different_seeds_give_different_tokens():
    reqs = [seeded(i, seed) for i, seed in enumerate((1, 2, 3))]
    run_steps([reqs], 30)
    outs = [tuple(r.output_token_ids) for r in reqs]
    assert len(set(outs)) == 3


def test_generator_is_created_once_in_the_callers_table_and_kept():
    req, table = seeded("g", 5), {}
    SamplingMetadata.build([req], vocab_size=VOCAB, device=CPU, generators_by_id=table)
    gen = table["g"]
    assert isinstance(gen, torch.Generator)
    SamplingMetadata.build([req], vocab_size=VOCAB, device=CPU, generators_by_id=table)
    assert table["g"] is gen and list(table) == ["g"]
    SamplingMetadata.build([make_request("z", vocab=VOCAB, seed=5, temperature=0.0)], vocab_size=VOCAB,
                           device=CPU, generators_by_id=table)
    assert "z" not in table          # a greedy row draws nothing, so it gets no generator


def test_mixed_batch_rows_equal_rows_sampled_alone():
    def fresh():
        return [
            make_request("greedy", prompt=[1, 2], output=[4], vocab=VOCAB, temperature=0.0),
            seeded("seeded", 77, temperature=0.7, min_p=0.05),
            make_request("unseeded", prompt=[1], vocab=VOCAB, top_k=5),
            make_request("greedy-pen", prompt=[3, 4], output=[5, 5], vocab=VOCAB, temperature=0.0,
                         repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
            make_request("seeded-pen", prompt=[3, 4], output=[5, 5], vocab=VOCAB, seed=8,
                         repetition_penalty=1.3, frequency_penalty=0.4, logit_bias={2: 1.0}),
        ]
    batch = fresh()
    run_steps([batch], 15)
    for i in (0, 1, 3, 4):
        row = fresh()[i]
        run_steps([[row]], 15, default_seed=1)
        assert row.output_token_ids == batch[i].output_token_ids, row.request_id


# ------------------------------------------------------------------ metadata shape and cost
def test_default_params_build_no_optional_tensors():
    meta = build([make_request(i) for i in range(4)])
    assert meta.all_random and not meta.all_greedy
    assert meta.no_penalties and meta.no_top_k and meta.no_top_p and meta.no_min_p
    assert meta.allowed_rows is None and meta.banned_rows is None and meta.bias_rows is None
    assert meta.max_num_logprobs is None and meta.generators == ()
    greedy = build([make_request(i, temperature=0.0) for i in range(2)])
    assert greedy.all_greedy and greedy.temperature is None


def test_sampler_does_not_modify_the_callers_logits():
    logits = torch.randn(2, 10)
    before = logits.clone()
    reqs = [make_request(0, repetition_penalty=1.5, allowed_token_ids=[1, 2, 3], top_k=2, temperature=0.5),
            make_request(1, temperature=0.0, logit_bias={1: 3.0}, logprobs=2)]
    sample(reqs, logits)
    assert torch.equal(logits, before)


def test_empty_batch():
    out = sample([], torch.zeros(0, 10), vocab=10)
    assert out.sampled_token_ids.shape == (0,) and out.logprobs == []


# ------------------------------------------------------------------ the model's logits: the native plain-row path
# The model runner hands the sampler the model's own logits on CPU (fp32, or bf16) with the native
# kernels of its CPU tier (kernels/csrc/cpu_sample.c): rows that use only a temperature are drawn
# there, the others by the torch path above on the same (upcast) logits and the same per-row
# uniform numbers. Every test runs for every native build this CPU tests (conftest.native_test_tiers;
# the `native` fixture) and both logits dtypes.

@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def logits_dtype(request):
    return request.param


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("vocab", [5, 37])  # 37: a partial last block of 16 (and of 8, and of 4)
def test_native_plain_rows_match_the_probabilities(native, logits_dtype, temperature, vocab):
    probs = torch.rand(vocab, generator=torch.Generator().manual_seed(vocab)) + 0.05
    probs[1] = 0.0                                   # log 0 = -inf: never drawn
    logits = (probs / probs.sum()).log().to(logits_dtype)
    powered = (logits.float() / temperature).softmax(-1)   # the exact target for these logits
    num = 4000
    reqs = [make_request(i, vocab=vocab, temperature=temperature) for i in range(num)]
    calls = []
    real = native.sample
    object.__setattr__(native, "sample", lambda *a: calls.append(1) or real(*a))  # prove the native path ran
    try:
        tokens = sample(reqs, logits.expand(num, vocab).contiguous(), native=native).sampled_token_ids
    finally:
        object.__delattr__(native, "sample")
    assert calls
    freqs = torch.bincount(tokens, minlength=vocab).float() / num
    assert freqs[1] == 0
    assert torch.allclose(freqs, powered, atol=0.03), (freqs, powered)


def test_native_greedy_is_the_first_argmax(native, logits_dtype):
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 0.0, 3.0, 0.0]]).to(logits_dtype)
    reqs = [make_request(0, vocab=4, temperature=0.0), make_request(1, vocab=4, temperature=0.0)]
    assert sample(reqs, logits, native=native).sampled_token_ids.tolist() == [1, 0]
    big = torch.randn(3, 50_000).to(logits_dtype)     # the model's vocabulary size: same argmax as torch
    reqs = [make_request(i, vocab=50_000, temperature=0.0) for i in range(3)]
    assert sample(reqs, big, native=native).sampled_token_ids.tolist() == big.float().argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [49_152, 49_152 + 37, 700])   # whole chunks of 32 vectors; a tail; chunks of 8/4 lanes only
def test_native_greedy_first_argmax_across_chunks_and_tail(native, logits_dtype, vocab):
    # The vectorised argmax (cpu_sample.c) scans chunks then one chunk: planted maxima at chunk
    # edges, ties in different chunks, a maximum in the tail, ties between a chunk and the tail, and
    # rows with nothing above -inf. Oracle: torch's argmax (the first maximal index).
    torch.manual_seed(vocab)
    cases = [[0], [vocab - 1], [255], [256], [511, 512], [4096, 100], [vocab - 30, 300], [vocab - 2, vocab - 1]]
    rows = []
    for planted in cases:
        row = torch.randn(vocab)
        row[[p % vocab for p in planted]] = 10.0
        rows.append(row)
    rows.append(torch.full((vocab,), float("-inf")))
    rows.append(torch.randn(vocab).round())           # many ties at the maximum (small integers)
    logits = torch.stack(rows).to(logits_dtype)
    reqs = [make_request(i, vocab=vocab, temperature=0.0) for i in range(len(rows))]
    assert sample(reqs, logits, native=native).sampled_token_ids.tolist() == logits.float().argmax(-1).tolist()


def test_native_rows_that_need_more_than_a_temperature_take_the_torch_path(native, logits_dtype):
    torch.manual_seed(3)
    logits = torch.randn(4, VOCAB).to(logits_dtype)
    def fresh():
        return [make_request("topk", vocab=VOCAB, top_k=3), make_request("plain", vocab=VOCAB),
                make_request("logprobs", vocab=VOCAB, logprobs=2), make_request("greedy", vocab=VOCAB, temperature=0)]
    got = sample(fresh(), logits.clone(), seed=5, native=native)
    want = sample(fresh(), logits.float(), seed=5)   # the torch path on the upcast logits, same draws
    assert got.sampled_token_ids[[0, 2, 3]].tolist() == want.sampled_token_ids[[0, 2, 3]].tolist()
    assert got.logprobs[2] is not None and got.logprobs[0] is None


def test_native_seeded_plain_row_is_batch_invariant_next_to_rows_of_the_torch_path(native, logits_dtype):
    def run(groups, steps, default_seed=99):
        sampler, default = Sampler(native=native), torch.Generator().manual_seed(default_seed)
        table = {}
        for step in range(steps):
            batch = groups[step % len(groups)]
            logits = torch.stack([next_logits(r) for r in batch]).to(logits_dtype)
            meta = SamplingMetadata.build(batch, vocab_size=VOCAB, device=CPU, generators_by_id=table)
            for r, t in zip(batch, sampler(logits, meta, default).sampled_token_ids.tolist()):
                r.append_output_token(t)
    alone = make_request("alone", prompt=[1], vocab=VOCAB, seed=1234)
    run([[alone]], 30)
    target = make_request("t", prompt=[1], vocab=VOCAB, seed=1234)
    others = [seeded(f"s{i}", 7 + i) for i in range(2)] + [make_request(f"u{i}", prompt=[1], vocab=VOCAB)
                                                           for i in range(2)]
    run([[target] + others[:2], others[2:] + [target], [others[3], target, others[0]]], 90)
    assert target.output_token_ids[:30] == alone.output_token_ids

"""Tests for vbatch.engine.detokenizer: incremental text vs tokenizer.decode, stop strings, streaming.

Oracles: `tokenizer.decode` of the whole output (or of prompt + output for SentencePiece-style
tokenizers), and a naive stop-string search that re-decodes the whole output after every token.
Tokenizers: SmolLM2's byte-level BPE (the default model's), and a tiny Metaspace + byte-fallback BPE
built here (Llama-2 style: leading-space rules, CJK/emoji split into byte tokens).
"""
from __future__ import annotations

import json
import random
import string

import pytest
import torch

from vbatch.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from vbatch.engine.sampling_params import SamplingParams

torch.set_num_threads(1)

PATHS = [pytest.param(None, id="fast"), pytest.param(False, id="offset")]

TEXTS = [
    "The capital of France is Paris.",
    "  leading spaces, trailing spaces   \n\nand\tTABS\r\n",
    "Emoji: 🎉🎉 👩‍👩‍👧 🇫🇷 ok",
    "中文测试：你好，世界！日本語もテスト。한국어도요.",
    "def f(x):\n    return x ** 2  # comment\n",
    "mixed Ünïcödé ß 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√ end",
    "repeat repeat repeat STOPSTOP stop",
    "The fox.<|im_end|>",
    "<|im_start|>assistant\nHi<|im_end|><|im_end|>",
]


# ---------------------------------------------------------------------------------- tokenizers
@pytest.fixture(scope="module")
def smol():
    """SmolLM2-135M-Instruct's tokenizer, via the model resolver (GGUF converted once, cached)."""
    from vbatch.engine.models.resolve import resolve_model

    path = resolve_model("smollm2-135m-instruct", quiet=True).path
    try:
        from vbatch.engine.tokenizer import load_tokenizer
    except ImportError:  # written by another engineer; the HF loader reads the same folder
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def metaspace():
    """A tiny Llama-2-style tokenizer: Metaspace pieces, byte fallback, decoder strips one leading space."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, this is a tiny corpus",
              "stop strings end the text here", "Paris is the capital of France"] * 5
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    alphabet = list(string.ascii_letters + string.digits + string.punctuation)
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=220, initial_alphabet=alphabet,
                                                            show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for token in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


# ---------------------------------------------------------------------------------- helpers
def feed(tok, prompt_ids, output_ids, params, use_fast, chunk_sizes=None, stop_terminated_last=False):
    """Run a detokenizer over output_ids (one token a step, or in chunks); returns (detok, stop, steps)."""
    d = IncrementalDetokenizer(tok, list(prompt_ids), params, use_fast=use_fast)
    i, steps, sizes = 0, 0, iter(chunk_sizes or [])
    while i < len(output_ids):
        n = next(sizes, 1)
        chunk = output_ids[i:i + n]
        i += len(chunk)
        steps += 1
        stop = d.update(chunk, stop_terminated=stop_terminated_last and i == len(output_ids))
        if stop is not None:
            return d, stop, steps
    return d, None, steps


def random_chunks(rng, n):
    return [rng.randint(1, 4) for _ in range(n)]


def chat_prompt(tok, text="Say something."):
    return tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def assert_decode_match(tok, output_ids, text, skip):
    """text equals decode(output_ids), except a trailing incomplete character may be withheld."""
    ref = tok.decode(output_ids, skip_special_tokens=skip)
    if text == ref:
        return
    # The only allowed difference: the last (up to 3) tokens end mid-character and are held back.
    assert ref.endswith("\ufffd"), (text, ref)
    held = [tok.decode(output_ids[:j], skip_special_tokens=skip) for j in range(max(0, len(output_ids) - 3),
                                                                               len(output_ids))]
    assert text in held, (text, ref)


# ---------------------------------------------------------------------------------- find_stop_string
def naive_first_stop(text, num_new_chars, stops):
    """All occurrences ending in the new text; the earliest end wins, ties by list order."""
    best = None
    for stop in stops:
        for start in range(len(text) - len(stop) + 1):
            end = start + len(stop)
            if text[start:end] == stop and end > len(text) - num_new_chars:
                if best is None or end < best[2]:
                    best = (stop, start, end)
                break  # the first occurrence ending in the new text is the earliest for this stop
    return best


def test_find_stop_string_hand_cases():
    assert find_stop_string("hello world", 5, ["world"]) == ("world", 6, 11)
    # "lo w" is text[3:7]: it ends inside the new text only when the new text starts before index 7.
    assert find_stop_string("hello world", 4, ["lo w"]) is None  # ended before the new text
    assert find_stop_string("hello world", 5, ["lo w"]) == ("lo w", 3, 7)
    # Two stops in one update: the one that completes first wins, not the first in the list.
    assert find_stop_string("abcdef", 6, ["def", "bc"]) == ("bc", 1, 3)
    assert find_stop_string("abcdef", 6, ["cd", "bcd"]) == ("cd", 2, 4)  # same end: list order
    assert find_stop_string("abc", 0, ["abc"]) is None


def test_find_stop_string_matches_naive_search():
    rng = random.Random(1)
    for _ in range(3000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        new = rng.randint(0, len(text))
        assert find_stop_string(text, new, stops) == naive_first_stop(text, new, stops), (text, new, stops)


# ---------------------------------------------------------------------------------- text == decode
@pytest.mark.parametrize("use_fast", PATHS)
@pytest.mark.parametrize("skip", [True, False])
def test_texts_fed_token_by_token_equal_decode(smol, use_fast, skip):
    params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=False)
    prompt = chat_prompt(smol)
    for text in TEXTS:
        ids = smol.encode(text, add_special_tokens=False)
        d, stop, _ = feed(smol, prompt, ids, params, use_fast)
        assert stop is None
        assert d.output_text == smol.decode(ids, skip_special_tokens=skip), text
        assert "\ufffd" not in d.output_text
        if skip:
            assert "<|im_end|>" not in d.output_text


@pytest.mark.parametrize("use_fast", PATHS)
def test_chunked_updates_equal_single_token_updates(smol, use_fast):
    rng = random.Random(2)
    params = SamplingParams()
    for text in TEXTS:
        ids = smol.encode(text, add_special_tokens=False)
        d, _, _ = feed(smol, [], ids, params, use_fast, chunk_sizes=random_chunks(rng, len(ids)))
        assert d.output_text == smol.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("use_fast", PATHS)
def test_random_token_ids_match_decode(smol, use_fast):
    """Uniformly random ids (special and byte-fragment tokens included), after random prompts."""
    rng = random.Random(3)
    vocab = len(smol)
    for _ in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 25))]
        prompt = smol.encode(rng.choice(TEXTS), add_special_tokens=False)
        for skip in (True, False):
            params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=False)
            d, _, _ = feed(smol, prompt, ids, params, use_fast)
            assert_decode_match(smol, ids, d.output_text, skip)


@pytest.mark.parametrize("use_fast", PATHS)
def test_multibyte_characters_split_across_tokens(smol, use_fast):
    """Each emoji/CJK character spans several byte tokens: none shows as U+FFFD while it forms."""
    text = "🎉👩‍👧中文𝔘"
    ids = smol.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # really split into byte pieces
    d = IncrementalDetokenizer(smol, [], SamplingParams(), use_fast=use_fast)
    for i in ids:
        d.update([i], False)
        assert "\ufffd" not in d.output_text
        assert text.startswith(d.output_text)
    assert d.output_text == text


@pytest.mark.parametrize("use_fast", PATHS)
def test_prompt_ending_mid_character(smol, use_fast):
    """The prompt's last token is half a character: the output decodes on its own (U+FFFD for the orphan
    bytes, as decode(output_ids) shows), never repeating prompt text."""
    ids = smol.encode("Hi 世界 there", add_special_tokens=False)
    pieces = [smol.decode(ids[:k]) for k in range(len(ids) + 1)]
    cut = next(k for k in range(1, len(ids)) if pieces[k].endswith("\ufffd"))
    d, _, _ = feed(smol, ids[:cut], ids[cut:], SamplingParams(), use_fast)
    assert d.output_text == smol.decode(ids[cut:])
    assert "Hi" not in d.output_text


@pytest.mark.parametrize("use_fast", PATHS)
def test_metaspace_first_token_keeps_its_leading_space(metaspace, use_fast):
    """SentencePiece style: with the prompt as context, " the" stays " the" (vLLM), while
    decode(output_ids) alone would strip it. Oracle: decode(prompt + out) minus decode(prompt)."""
    prompt = metaspace.encode("hello world,", add_special_tokens=False)
    for text in ["the quick fox", "the fox 世界 🎉 end", "Paris is the capital", "x  y"]:
        out = metaspace.encode(text, add_special_tokens=False)[:]
        if metaspace.convert_ids_to_tokens(out[0]) == "▁":  # "▁" alone: make the output start mid-text
            out = out[1:]
        full = metaspace.decode(prompt + out)
        expected = full[len(metaspace.decode(prompt)):]
        d, _, _ = feed(metaspace, prompt, out, SamplingParams(), use_fast)
        assert d.output_text == expected, text
        assert "\ufffd" not in d.output_text
    # The documented difference from decode(output_ids): only the first token's leading space.
    out = metaspace.encode("the fox", add_special_tokens=False)
    d, _, _ = feed(metaspace, prompt, out, SamplingParams(), use_fast)
    assert d.output_text == " " + metaspace.decode(out)


@pytest.mark.parametrize("use_fast", PATHS)
def test_metaspace_bos_only_prompt_and_special_tokens(metaspace, use_fast):
    bos, eos = metaspace.bos_token_id, metaspace.eos_token_id
    out = metaspace.encode("the dog", add_special_tokens=False) + [eos]
    for skip in (True, False):
        params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=False)
        d, _, _ = feed(metaspace, [bos], out, params, use_fast)
        full = metaspace.decode([bos] + out, skip_special_tokens=skip)
        assert d.output_text == full[len(metaspace.decode([bos], skip_special_tokens=skip)):]


# ---------------------------------------------------------------------------------- stop strings
def naive_stop_run(tok, output_ids, stops, min_tokens, include):
    """Re-decode everything after each token; fire at the first step with a stop ending after the
    min_tokens text, earliest end first. Returns (text, stop, step)."""
    protected = len(tok.decode(output_ids[:min_tokens]).rstrip("\ufffd")) if min_tokens else 0
    for k in range(1, len(output_ids) + 1):
        text = tok.decode(output_ids[:k]).rstrip("\ufffd")
        if k <= min_tokens:
            continue
        best = naive_first_stop(text, len(text) - protected, stops)
        if best is not None:
            stop, start, end = best
            return text[:end] if include else text[:start], stop, k
    return tok.decode(output_ids).rstrip("\ufffd"), None, None


STOP_CASES = [
    ("The capital of France is Paris.", ["Paris"]),
    ("The capital of France is Paris.", ["The"]),                 # at the very start
    ("The capital of France is Paris.", [" capital of Fr"]),      # spans several tokens
    ("The capital of France is Paris.", ["."]),                   # the last character
    ("repeat repeat repeat STOPSTOP stop", ["STOP"]),             # repeated: the first one fires
    ("repeat repeat repeat STOPSTOP stop", ["PST", "peat r"]),    # two stops: the earliest end wins
    ("Emoji: 🎉🎉 👩‍👩‍👧 🇫🇷 ok", ["🎉 👩"]),                       # multi-byte stop across tokens
    ("中文测试：你好，世界！日本語もテスト。", ["世界"]),
    ("no stop here", ["zzz", "yy"]),
]


@pytest.mark.parametrize("use_fast", PATHS)
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_hand_cases(smol, use_fast, include):
    for text, stops in STOP_CASES:
        ids = smol.encode(text, add_special_tokens=False)
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        d, stop, _ = feed(smol, [], ids, params, use_fast)
        exp_text, exp_stop, _ = naive_stop_run(smol, ids, stops, 0, include)
        assert (d.output_text, stop) == (exp_text, exp_stop), (text, stops)
    # Spelled out for one case, independent of the naive runner.
    ids = smol.encode("The capital of France is Paris. Yes.", add_special_tokens=False)
    d, stop, _ = feed(smol, [], ids, SamplingParams(stop=["Paris"], include_stop_str_in_output=include), use_fast)
    assert stop == "Paris"
    assert d.output_text == ("The capital of France is Paris" if include else "The capital of France is ")


@pytest.mark.parametrize("use_fast", PATHS)
def test_stop_strings_random_against_naive(smol, use_fast):
    """Random stops (substrings of the text and near misses), min_tokens, chunk sizes, include flag."""
    rng = random.Random(4)
    for _ in range(120):
        text = rng.choice(TEXTS[:7])
        ids = smol.encode(text, add_special_tokens=False)
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(text))
            stops.append(text[a:a + rng.randint(1, 6)] + rng.choice(["", "", "q"]))
        min_tokens = rng.choice([0, 0, 1, 3, 6])
        include = rng.random() < 0.5
        params = SamplingParams(stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens,
                                max_tokens=max(16, min_tokens))
        chunks = random_chunks(rng, len(ids)) if rng.random() < 0.5 else None
        d, stop, _ = feed(smol, [], ids, params, use_fast, chunk_sizes=chunks)
        exp_text, exp_stop, _ = naive_stop_run(smol, ids, stops, min_tokens, include)
        assert (d.output_text, stop) == (exp_text, exp_stop), (text, stops, min_tokens, include, chunks)


def test_min_tokens_suppresses_early_stop(smol):
    ids = smol.encode("stop and stop again", add_special_tokens=False)
    first = smol.encode("stop", add_special_tokens=False)
    assert ids[:len(first)] == first
    # Within min_tokens the first "stop" is ignored; the second one fires.
    params = SamplingParams(stop=["stop"], min_tokens=len(first))
    d, stop, _ = feed(smol, [], ids, params, None)
    assert stop == "stop" and d.output_text == "stop and "
    # Without min_tokens it fires at once.
    d, stop, steps = feed(smol, [], ids, SamplingParams(stop=["stop"]), None)
    assert (stop, d.output_text, steps) == ("stop", "", len(first))


@pytest.mark.parametrize("use_fast", PATHS)
def test_stop_terminated_token_text(smol, use_fast):
    """A stop token id's text is dropped unless include_stop_str_in_output (vLLM); a special EOS
    decodes to nothing when skip_special_tokens."""
    body = smol.encode("All done", add_special_tokens=False)
    dot = smol.encode(".", add_special_tokens=False)
    eos = smol.convert_tokens_to_ids("<|im_end|>")
    cases = [  # (last token, params, expected text)
        (dot[0], SamplingParams(), "All done"),
        (dot[0], SamplingParams(include_stop_str_in_output=True), "All done."),
        (eos, SamplingParams(), "All done"),
        (eos, SamplingParams(include_stop_str_in_output=True), "All done"),
        (eos, SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False), "All done"),
        (eos, SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False,
                             include_stop_str_in_output=True), "All done<|im_end|>"),
    ]
    assert len(dot) == 1
    for last, params, expected in cases:
        for chunks in (None, [len(body) + 1]):
            d, stop, _ = feed(smol, [], body + [last], params, use_fast, chunk_sizes=chunks,
                              stop_terminated_last=True)
            assert stop is None and d.output_text == expected
            assert d.num_output_tokens == len(body) + 1


def test_spaces_between_special_tokens(smol):
    """Fast path: byte-level BPE puts nothing between tokens, so both settings equal decode. Offset path
    with the default True: HF slow-tokenizer rule, runs between added tokens joined by single spaces."""
    ids = smol.encode("All done<|im_end|><|im_end|>ok", add_special_tokens=False)
    for spaces in (True, False):
        params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
        d, _, _ = feed(smol, [], ids, params, None)
        assert d.output_text == "All done<|im_end|><|im_end|>ok"
        d, _, _ = feed(smol, [], ids, params, False)
        assert d.output_text == ("All done <|im_end|> <|im_end|> ok" if spaces else "All done<|im_end|><|im_end|>ok")


# ---------------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("include", [False, True])
def test_streamed_deltas_never_show_text_that_is_cut(smol, include):
    text = "The capital of France is Paris. It is big."
    ids = smol.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=["Paris.", "big"], include_stop_str_in_output=include)
    d = IncrementalDetokenizer(smol, [], params)
    shown, stop = "", None
    for i in ids:
        stop = d.update([i], False)
        if stop is not None:
            break
        shown += d.get_next_output_text(finished=False, delta=True)
        cumulative = d.get_next_output_text(finished=False, delta=False)
        assert shown == cumulative
        assert len(d.output_text) - len(cumulative) == (0 if include else len("Paris.") - 1) or \
            len(d.output_text) < len("Paris.")
    shown += d.get_next_output_text(finished=True, delta=True)
    final = "The capital of France is Paris." if include else "The capital of France is "
    assert stop == "Paris." and d.output_text == final and shown == final
    assert d.get_next_output_text(finished=True, delta=True) == ""


def test_per_step_state_stays_small(smol):
    """Long outputs: the offset path keeps a bounded token window; the stop tail stays <= len(stop)-1."""
    ids = smol.encode("word " * 2000, add_special_tokens=False)
    params = SamplingParams(stop=["never-appears"])
    d = IncrementalDetokenizer(smol, [], params, use_fast=False)
    for i in ids:
        d.update([i], False)
    assert len(d._decoder._tokens) <= 8
    assert len(d._tail) == len("never-appears") - 1
    assert d.output_text == "word " * 2000


# ---------------------------------------------------------------------------------- real generations
@pytest.mark.slow
def test_sampled_generations_of_the_real_model(smol):
    """Text sampled from SmolLM2 (temperature 1.3, so odd tokens and split characters turn up)."""
    from transformers import AutoModelForCausalLM

    from vbatch.engine.models.resolve import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct", quiet=True).path,
                                                 dtype=torch.float32)
    torch.manual_seed(0)
    prompt = chat_prompt(smol, "Write a short poem in English, Chinese and emoji.")
    gen = model.generate(torch.tensor([prompt]), do_sample=True, temperature=1.3, top_k=0, top_p=1.0,
                         max_new_tokens=40, num_return_sequences=6, pad_token_id=smol.eos_token_id)
    for row in gen.tolist():
        out = row[len(prompt):]
        for use_fast in (None, False):
            for skip in (True, False):
                params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=False)
                d, _, _ = feed(smol, prompt, out, params, use_fast)
                assert_decode_match(smol, out, d.output_text, skip)

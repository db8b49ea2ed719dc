"""SamplingParams validation and normalisation (REFERENCE 1.3): every rule, one bad value each."""
from __future__ import annotations

import pytest

from vbatch.engine.errors import ConfigError, SamplingParamsError
from vbatch.engine.sampling_params import SamplingParams

BAD_VALUES = [
    # (field, kwargs)
    ("n", dict(n=0)),
    ("n", dict(n=1.5)),
    ("n", dict(n=True)),
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=2.5)),
    ("temperature", dict(temperature=float("nan"))),
    ("temperature", dict(temperature="1")),
    ("n", dict(temperature=0.0, n=2)),                 # greedy needs n == 1
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.01)),
    ("top_p", dict(top_p=float("nan"))),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=2.0)),
    ("min_p", dict(min_p=-0.01)),
    ("min_p", dict(min_p=1.5)),
    ("presence_penalty", dict(presence_penalty=2.01)),
    ("presence_penalty", dict(presence_penalty=-2.5)),
    ("frequency_penalty", dict(frequency_penalty=-2.01)),
    ("frequency_penalty", dict(frequency_penalty=3)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("repetition_penalty", dict(repetition_penalty=float("nan"))),
    ("seed", dict(seed=1.5)),
    ("seed", dict(seed="7")),
    ("seed", dict(seed=2**64)),
    ("stop", dict(stop="")),
    ("stop", dict(stop=["ok", ""])),
    ("stop", dict(stop=[3])),
    ("stop", dict(stop=5)),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop_token_ids", dict(stop_token_ids=[1.0])),
    ("stop_token_ids", dict(stop_token_ids=7)),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-3)),
    ("max_tokens", dict(max_tokens=2.0)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=17, max_tokens=16)),
    ("logprobs", dict(logprobs=-1)),
    ("logprobs", dict(logprobs=21)),
    ("prompt_logprobs", dict(prompt_logprobs=-1)),
    ("prompt_logprobs", dict(prompt_logprobs=21)),
    ("logit_bias", dict(logit_bias={1: 100.5})),
    ("logit_bias", dict(logit_bias={1: -101})),
    ("logit_bias", dict(logit_bias={-1: 1.0})),
    ("logit_bias", dict(logit_bias={"abc": 1.0})),
    ("logit_bias", dict(logit_bias={1: "x"})),
    ("logit_bias", dict(logit_bias=[1, 2])),
    ("logit_bias", dict(logit_bias={1: float("nan")})),
    ("allowed_token_ids", dict(allowed_token_ids=[])),
    ("allowed_token_ids", dict(allowed_token_ids=[3, -1])),
    ("allowed_token_ids", dict(allowed_token_ids=5)),
    ("bad_words", dict(bad_words=[""])),
    ("bad_words", dict(bad_words=["  "])),
    ("bad_words", dict(bad_words=[3])),
    ("bad_words", dict(bad_words=4)),
    ("structured_outputs", dict(structured_outputs={"json": {}})),
]


@pytest.mark.parametrize("field,kwargs", BAD_VALUES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_VALUES)])
def test_bad_value_raises_naming_the_field(field, kwargs):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(field + ":")
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


def test_boundary_values_are_accepted():
    SamplingParams(temperature=0.0)
    SamplingParams(temperature=2.0, top_p=1.0, top_k=-1, min_p=1.0)
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.01)
    SamplingParams(logprobs=0, prompt_logprobs=20, min_tokens=16, max_tokens=16)
    SamplingParams(max_tokens=None, min_tokens=1000)
    SamplingParams(logit_bias={0: -100.0, 5: 100}, allowed_token_ids=[0], seed=-3)
    SamplingParams(seed=2**64 - 1)


def test_greedy_resets_truncation_fields():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.3)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert p.is_greedy
    q = SamplingParams(temperature=1e-6, top_k=3)
    assert q.is_greedy and q.top_k == 0
    r = SamplingParams(temperature=0.5, top_p=0.5, top_k=5, min_p=0.3)
    assert (r.top_p, r.top_k, r.min_p) == (0.5, 5, 0.3)
    assert not r.is_greedy


def test_normalisation_of_lists_and_top_k():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []
    assert SamplingParams().bad_words == []
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(logit_bias={"5": "1.5"}).logit_bias == {5: 1.5}


@pytest.mark.parametrize("field,kwargs", [
    ("stop_token_ids", dict(stop_token_ids=[3, 10])),
    ("allowed_token_ids", dict(allowed_token_ids=[0, 12])),
    ("logit_bias", dict(logit_bias={10: 1.0})),
])
def test_check_vocab_rejects_out_of_vocab_ids(field, kwargs):
    p = SamplingParams(**kwargs)
    with pytest.raises(SamplingParamsError) as info:
        p.check_vocab(10)
    assert info.value.field == field
    with pytest.raises(SamplingParamsError):
        p.resolve(eos_token_ids=[0], vocab_size=10)
    p.check_vocab(13)   # fits a larger vocabulary


def test_resolve_adds_eos_unless_ignore_eos():
    p = SamplingParams(stop_token_ids=[4]).resolve(eos_token_ids=[2, 3], vocab_size=10)
    assert p.all_stop_token_ids == frozenset({2, 3, 4}) and p.vocab_size == 10
    q = SamplingParams(stop_token_ids=[4], ignore_eos=True).resolve(eos_token_ids=[2, 3], vocab_size=10)
    assert q.all_stop_token_ids == frozenset({4})
    # resolve returns a copy; the original stays unresolved.
    base = SamplingParams()
    assert base.resolve(eos_token_ids=[1], vocab_size=5) is not base and base.all_stop_token_ids == frozenset()


class _FakeTokenizer:
    """Word -> ids: a leading space gives a different first id (like BPE tokenizers)."""

    vocab = {"bad": [5], " bad": [6], "two words": [7, 8], " two words": [9, 8]}

    def encode(self, text, add_special_tokens=False):
        assert add_special_tokens is False
        return list(self.vocab[text])


def test_resolve_bad_words_with_and_without_leading_space():
    p = SamplingParams(bad_words=["bad", " two words"]).resolve(
        eos_token_ids=[0], vocab_size=10, tokenizer=_FakeTokenizer())
    assert set(p.bad_words_token_ids) == {(5,), (6,), (7, 8), (9, 8)}


def test_from_dict_round_trip_and_unknown_key():
    p = SamplingParams(temperature=0.3, stop=["x"], seed=4, logit_bias={1: 2.0})
    assert SamplingParams.from_dict(p.to_dict()) == p
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams.from_dict({"temperature": 0.5, "best_of": 2})
    assert info.value.field == "best_of"
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams.from_dict({"use_beam_search": True})
    assert info.value.field == "use_beam_search"


def test_replace_revalidates():
    p = SamplingParams(temperature=0.5)
    with pytest.raises(SamplingParamsError) as info:
        p.replace(top_p=0.0)
    assert info.value.field == "top_p"
    assert p.replace(temperature=0.0, top_k=4).top_k == 0

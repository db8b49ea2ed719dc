"""SamplingParams: how one request is sampled (vLLM 0.33 fields and rules, REFERENCE 1.3).

Frozen: the engine shares one object between requests. `__post_init__` validates every
field (a SamplingParamsError naming the field and its allowed range) and normalises
(greedy resets the truncation fields); it does no I/O. The engine-only fields that a
tokenizer or generation_config decides (`all_stop_token_ids`, bad-word token ids) are
computed by `resolve()`, which returns a new object.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import SamplingParamsError

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


def _err(name: str, message: str) -> SamplingParamsError:
    return SamplingParamsError(name, message)


def _as_list(name: str, value: Any) -> list:
    """None -> [], a list/tuple/set -> a new list; anything else names the field."""
    if value is None:
        return []
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    raise _err(name, f"must be a list, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: Any = None
    # Filled by resolve(): EOS + generation_config eos ids + stop_token_ids (what ends a request).
    all_stop_token_ids: frozenset[int] = field(default_factory=frozenset, repr=False)
    # Filled by resolve(): each bad word as token-id sequences (with and without a leading space).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    # Filled by resolve(): the vocabulary size the ids were checked against (0: not yet).
    vocab_size: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  frozen normalisation
        if isinstance(self.stop, str):
            set_("stop", [self.stop])
        set_("stop", _as_list("stop", self.stop))
        set_("stop_token_ids", _as_list("stop_token_ids", self.stop_token_ids))
        set_("bad_words", _as_list("bad_words", self.bad_words))
        if self.allowed_token_ids is not None:
            set_("allowed_token_ids", _as_list("allowed_token_ids", self.allowed_token_ids))
        if self.logit_bias is not None:
            try:
                set_("logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()})
            except (TypeError, ValueError, AttributeError) as e:
                raise _err("logit_bias", f"must map token ids to floats ({e})") from None
        self._validate()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the truncation fields mean nothing; reset them as vLLM does.
            set_("top_p", 1.0)
            set_("top_k", 0)
            set_("min_p", 0.0)
        if self.top_k == -1:
            set_("top_k", 0)

    # ----------------------------------------------------------------------------------
    def _validate(self) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1:
            raise _err("n", f"must be an integer >= 1, got {self.n!r}")
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise _err("temperature", f"must be in [0, 2], got {self.temperature!r}")
        if self.temperature < _GREEDY_EPS and self.n > 1:
            raise _err("n", f"must be 1 when sampling greedily (temperature 0), got {self.n}")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _err("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise _err("top_k", f"must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _err("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2.0 <= v <= 2.0:
                raise _err(name, f"must be in [-2, 2], got {v!r}")
        if not is_num(self.repetition_penalty) or not self.repetition_penalty > 0.0:
            raise _err("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and (not is_int(self.seed) or not -2**63 <= self.seed < 2**64):
            # The range torch.Generator.manual_seed accepts: fail here, not mid-run.
            raise _err("seed", f"must be a 64-bit integer or None, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise _err("stop", f"must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0:
                raise _err("stop_token_ids", f"must be non-negative token ids, got {t!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise _err("max_tokens", f"must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise _err("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _err("min_tokens", f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise _err(name, f"must be an integer in [0, {MAX_LOGPROBS}] or None, got {v!r}")
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                if tok < 0:
                    raise _err("logit_bias", f"token id {tok} must be >= 0")
                if not -100.0 <= bias <= 100.0:
                    raise _err("logit_bias", f"bias for token {tok} must be in [-100, 100], got {bias}")
        if self.allowed_token_ids is not None:
            if len(self.allowed_token_ids) == 0:
                raise _err("allowed_token_ids", "must not be empty")
            for t in self.allowed_token_ids:
                if not is_int(t) or t < 0:
                    raise _err("allowed_token_ids", f"must be non-negative token ids, got {t!r}")
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip():
                raise _err("bad_words", f"must be non-empty strings, got {w!r}")
        if self.structured_outputs is not None:
            raise _err("structured_outputs", "is not supported yet by vbatch")

    # ----------------------------------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def is_plain(self) -> bool:
        """The token comes from the logits and the temperature alone (greedy: the argmax): nothing
        edits or reads the logits (no penalties, bias, allowed or bad words, top-k/p or min-p,
        logprobs) and no stop string is looked for (the sampler's plain rows,
        engine/sampling_metadata.py). min_tokens, which bans the stop tokens until it is met, is the
        caller's to check. Such requests may decode several steps in one call (engine/scheduler.py
        multi-step decodes)."""
        top_k_off = self.top_k <= 0 or (self.vocab_size > 0 and self.top_k >= self.vocab_size)
        return (self.logprobs is None and not self.stop and top_k_off and self.top_p >= 1.0
                and self.min_p <= 0.0 and self.repetition_penalty == 1.0 and self.frequency_penalty == 0.0
                and self.presence_penalty == 0.0 and not self.logit_bias and self.allowed_token_ids is None
                and not self.bad_words_token_ids and self.structured_outputs is None)

    def replace(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if a token id field names a token outside the vocabulary."""
        fields = {
            "stop_token_ids": self.stop_token_ids,
            "allowed_token_ids": self.allowed_token_ids or [],
            "logit_bias": list((self.logit_bias or {}).keys()),
        }
        for name, ids in fields.items():
            for t in ids:
                if t >= vocab_size:
                    raise _err(name, f"token id {t} is outside the vocabulary [0, {vocab_size})")

    def resolve(self, *, eos_token_ids: list[int] | tuple[int, ...], vocab_size: int,
                tokenizer: Any = None) -> "SamplingParams":
        """Return a copy with the engine-only fields filled (stop ids, bad-word ids, vocab)."""
        self.check_vocab(vocab_size)
        stops = set(self.stop_token_ids)
        if not self.ignore_eos:
            stops.update(int(e) for e in eos_token_ids)
        bad: list[tuple[int, ...]] = []
        if self.bad_words and tokenizer is not None:
            for word in self.bad_words:
                for variant in (word.lstrip(), " " + word.lstrip()):
                    ids = tuple(tokenizer.encode(variant, add_special_tokens=False))
                    if ids and ids not in bad:
                        bad.append(ids)
        return dataclasses.replace(self, all_stop_token_ids=frozenset(stops),
                                   bad_words_token_ids=tuple(bad), vocab_size=vocab_size)

    def to_dict(self) -> dict[str, Any]:
        """The user-facing fields (for output records and logs)."""
        hidden = {"all_stop_token_ids", "bad_words_token_ids", "vocab_size"}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in hidden}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        """Build from a record's dict; unknown keys are a SamplingParamsError naming them."""
        known = {f.name for f in dataclasses.fields(cls)} - {"all_stop_token_ids", "bad_words_token_ids", "vocab_size"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise _err(unknown[0], f"is not a SamplingParams field (known: {', '.join(sorted(known))})")
        return cls(**data)

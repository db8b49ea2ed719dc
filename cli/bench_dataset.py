"""Benchmark prompts: seeded random (or fixed-length) token-id prompts, like vLLM's random dataset.

Called by `vbatch bench throughput` (cli/bench.py) and by `bench/peers.py`, which feeds the
very same token ids to every system it compares. Pure: numpy and a tokenizer's special ids in,
lists of token ids out; no torch, no engine. The same seed always gives the same prompts, on
any machine (numpy's PCG64 stream is stable across releases).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..engine.errors import ConfigError

DATASETS = ("random", "fixed")


@dataclass(frozen=True)
class LengthRange:
    """Prompt lengths in tokens, both ends inclusive; `low == high` is a fixed length."""

    low: int
    high: int

    @property
    def is_fixed(self) -> bool:
        return self.low == self.high

    def __str__(self) -> str:
        return str(self.low) if self.is_fixed else f"{self.low}-{self.high}"


def parse_length_range(text: str, field: str = "--input-len") -> LengthRange:
    """'256' -> 256..256; '128-512' -> 128..512. Bad text is a ConfigError naming the flag."""
    parts = str(text).strip().split("-")
    try:
        bounds = [int(p) for p in parts]
    except ValueError:
        raise ConfigError(field, f"cannot read {text!r} as a length; use e.g. 256 or 128-512") from None
    if len(bounds) == 1:
        bounds = bounds * 2
    if len(bounds) != 2:
        raise ConfigError(field, f"cannot read {text!r} as a length; use e.g. 256 or 128-512")
    low, high = bounds
    if low < 1 or high < low:
        raise ConfigError(field, f"needs 1 <= low <= high, got {text!r}")
    return LengthRange(low, high)


def special_token_ids(tokenizer) -> set[int]:
    """Every id the tokenizer treats as special (BOS/EOS/PAD, chat markers, added special tokens)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(token, "special", False):
            ids.update(tokenizer.convert_tokens_to_ids([token.content]))
    return {int(i) for i in ids if i is not None and int(i) >= 0}


def allowed_token_ids(vocab_size: int, excluded: Iterable[int]) -> np.ndarray:
    """The ids a prompt may hold: 0..vocab_size-1 without the excluded (special) ones."""
    mask = np.ones(vocab_size, dtype=bool)
    for i in excluded:
        if 0 <= i < vocab_size:
            mask[i] = False
    ids = np.nonzero(mask)[0]
    if ids.size == 0:
        raise ConfigError("--model", "the vocabulary holds only special tokens; cannot build prompts")
    return ids  # [num_allowed]


def build_prompts(*, num_prompts: int, input_len: LengthRange, vocab_size: int, excluded_ids: Iterable[int],
                  seed: int, dataset: str = "random") -> list[list[int]]:
    """`num_prompts` prompts of token ids.

    random: each length uniform in [low, high], each token uniform over the allowed ids.
    fixed: every prompt exactly `input_len.high` tokens (token ids still random, so prompts differ
    and prefix caching finds nothing, as with vLLM's random dataset).
    """
    if dataset not in DATASETS:
        raise ConfigError("--dataset", f"must be one of {', '.join(DATASETS)}, got {dataset!r}")
    if num_prompts < 1:
        raise ConfigError("--num-prompts", f"must be >= 1, got {num_prompts}")
    allowed = allowed_token_ids(vocab_size, excluded_ids)
    rng = np.random.Generator(np.random.PCG64(seed))
    if dataset == "fixed":
        lengths = np.full(num_prompts, input_len.high, dtype=np.int64)
    else:
        lengths = rng.integers(input_len.low, input_len.high + 1, size=num_prompts)
    return [allowed[rng.integers(0, allowed.size, size=int(n))].tolist() for n in lengths]


def prompts_digest(prompts: Sequence[Sequence[int]]) -> str:
    """A short hash of the token ids: two systems ran the same prompts iff their digests agree."""
    blob = json.dumps([list(map(int, p)) for p in prompts], separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]

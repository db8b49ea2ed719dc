"""Sampler: turns one step's logits into next tokens (and logprobs), vLLM V1 semantics.

Called by the model runner with the logits of the rows that sample this step and the
step's SamplingMetadata. Steps, in order (vLLM 0.33's order):

1. Logprobs, when any row asks, come from the raw logits (`log_softmax` before processing).
2. Masks: allowed_token_ids, bad words, min_tokens (stop ids) -> -inf; logit_bias added.
3. Penalties: repetition (prompt + output), frequency and presence (output).
4. Greedy rows: argmax of the processed logits.
5. Random rows: temperature, min_p, top-k/top-p, then one draw from the resulting distribution:
   on CPU by inverting the cumulative sum with one uniform number per row, on GPU by the
   exponential race `argmax(probs / q)`, q ~ Exp(1) (kernels/sampling_ref.py, the Triton
   sampler's spec). A seeded row draws with its own generator, the others with
   `default_generator`, so a seeded row's tokens do not depend on the batch.
6. Per asking row: the sampled token's logprob and rank, then the top-k.

`compute_prompt_logprobs` serves the prompt side (the runner calls it per request chunk).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import logits_processors as lp
from .sampling_metadata import SamplingMetadata
from .scheduler_output import Logprobs


@dataclass(frozen=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor          # [num_rows] int64
    logprobs: list[Logprobs | None]          # per row; None where the row did not ask


class Sampler:
    def __init__(self, native=None) -> None:
        """native: the model's NativeKernels (kernels/cpu_native.py, `Ops.native`), whose sampler
        draws the plain rows straight from the model's fp32 or bf16 logits on CPU; None: torch only."""
        self.native = native

    def __call__(self, logits: torch.Tensor,                 # [num_rows, vocab] float32 (CPU: or bf16)
                 meta: SamplingMetadata,
                 default_generator: torch.Generator | None = None, owned: bool = False) -> SamplerOutput:
        """owned: the caller hands `logits` over (a fresh tensor it will not read again), so
        the processing may edit it in place instead of a copy (at batch 256 x 49k vocab the copy
        alone took 12 ms per step)."""
        assert logits.dim() == 2 and logits.shape[0] == meta.num_rows, (logits.shape, meta.num_rows)
        # CPU: one uniform number per random row, drawn once here whichever path uses it.
        u = None if meta.all_greedy or logits.device.type != "cpu" else uniform_per_row(
            meta.num_rows, meta.generators, default_generator)
        fast = None
        if (self.native is not None and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16)
                and logits.stride(1) == 1 and any(meta.plain_rows)):
            fast = _sample_plain_rows_native(self.native, logits, meta, u)
            if all(meta.plain_rows):
                return SamplerOutput(sampled_token_ids=fast, logprobs=[None] * meta.num_rows)
        if logits.dtype == torch.bfloat16 and logits.device.type == "cpu":  # the runner's model logits
            logits, owned = logits.float(), True
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)  # [num_rows, vocab]

        # Everything below edits a private copy (unless handed over): the caller's logits stay as they were.
        if not (owned and logits.dtype == torch.float32):
            logits = logits.to(torch.float32, copy=True)
        apply_logits_processors(logits, meta)

        sampled = self._sample(logits, meta, u, default_generator)    # [num_rows] int64
        if fast is not None:  # plain rows keep the native draw, whatever else is in the batch
            sampled = torch.where(torch.tensor(meta.plain_rows), fast, sampled)
        logprobs: list[Logprobs | None] = [None] * meta.num_rows
        if raw_logprobs is not None:
            logprobs = _gather_sample_logprobs(raw_logprobs, sampled, meta.num_logprobs,
                                               meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _sample(logits: torch.Tensor, meta: SamplingMetadata, u: torch.Tensor | None,
                default_generator: torch.Generator | None = None) -> torch.Tensor:
        # An empty batch counts as all greedy: argmax of [0, vocab] is the empty answer.
        if meta.all_greedy:
            return logits.argmax(dim=-1)                              # [num_rows]
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        if not meta.temperature_all_one:
            logits.div_(meta.temperature.unsqueeze(1))
        if meta.min_p is not None:
            lp.apply_min_p(logits, meta.min_p)
        lp.apply_top_k_top_p(logits, meta.top_k, meta.top_p, meta.max_top_k)
        probs = logits.softmax(dim=-1)                                # [num_rows, vocab]
        if u is not None:
            random = _inverse_cdf_sample(probs, u)
        else:
            q = _exponential_noise(probs, meta.generators, default_generator)
            random = probs.div_(q).argmax(dim=-1)                     # [num_rows]
        if greedy is None:
            return random
        return torch.where(meta.is_greedy, greedy, random)


def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """Steps 2-3 in place on `logits` [num_rows, vocab]: masks, bias, then penalties."""
    if meta.allowed_rows is not None:
        lp.apply_allowed_token_ids(logits, meta.allowed_rows, meta.allowed_mask)
    if meta.banned_rows is not None:
        lp.apply_banned_tokens(logits, meta.banned_rows, meta.banned_token_ids)
    if meta.bias_rows is not None:
        lp.apply_logit_bias(logits, meta.bias_rows, meta.bias_token_ids, meta.bias_values)
    if not meta.no_penalties:
        lp.apply_penalties(logits, meta.prompt_token_mask, meta.output_token_counts,
                           meta.repetition_penalties, meta.frequency_penalties,
                           meta.presence_penalties)


def uniform_per_row(num_rows: int, generators: tuple[tuple[int, torch.Generator], ...],
                     default_generator: torch.Generator | None) -> torch.Tensor:  # [num_rows] float32
    """U[0, 1) per row: seeded rows from their own generator (exactly one draw per step, whatever
    the batch), the others from `default_generator`."""
    u = torch.empty(num_rows, dtype=torch.float32)
    if len(generators) < num_rows:
        u.uniform_(generator=default_generator)
    for row, gen in generators:
        u[row:row + 1].uniform_(generator=gen)
    return u


def _inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from `probs` [num_rows, vocab] by inverting its cumulative sum at u [num_rows] (CPU).

    NOTE: why not the exponential race here: it needs a random number per vocabulary entry, and
    on CPU drawing them (single-threaded) took 9 ms per step at batch 64 x 49k vocab, 7% of a whole
    throughput run; this uses one number per row. Both sample exactly the same distribution.
    Tokens with probability 0 (filtered out) have a zero-width interval and are never chosen:
    the search returns the first entry whose cumulative sum exceeds u * total.
    """
    cdf = probs.cumsum_(dim=-1)                                       # [num_rows, vocab], in place
    target = (u.unsqueeze(1) * cdf[:, -1:]).to(cdf.dtype)             # [num_rows, 1]
    token = torch.searchsorted(cdf, target, right=True)               # [num_rows, 1]
    return token.clamp_(max=probs.shape[1] - 1).squeeze(1)


def _sample_plain_rows_native(native, logits: torch.Tensor, meta: SamplingMetadata,
                              u: torch.Tensor | None) -> torch.Tensor:   # u: None only when every row is greedy
    """Every row drawn by the native kernel (kernels/csrc/cpu_sample.c) straight from the model's
    logits as if it were plain (temperature only; greedy rows: argmax); the caller keeps the plain rows'."""
    return native.sample(logits, plain_temperature(meta), u, torch.get_num_threads())   # u: drawn for any random row


def plain_temperature(meta: SamplingMetadata) -> torch.Tensor | None:
    """Each row's temperature as the native sampler takes it (cpu_sample.c: 0 for a greedy row); None
    when every row is greedy."""
    if meta.all_greedy:
        return None
    temperature = meta.temperature.clone()                            # [num_rows]
    if meta.is_greedy is not None:
        temperature[meta.is_greedy] = 0.0
    return temperature


def _exponential_noise(probs: torch.Tensor, generators: tuple[tuple[int, torch.Generator], ...],
                       default_generator: torch.Generator | None) -> torch.Tensor:
    """Exp(1) noise per row; seeded rows draw a whole row from their own generator.

    NOTE: a seeded row always draws exactly `vocab` numbers per step from its own generator,
    whatever its position or batch, which is what makes seeded sampling batch-invariant.
    """
    q = torch.empty_like(probs)                                       # [num_rows, vocab]
    if len(generators) < probs.shape[0]:
        _exponential_(q, default_generator)
    for row, gen in generators:
        _exponential_(q[row], gen)
    return q


def _exponential_(out: torch.Tensor, generator: torch.Generator | None) -> None:
    """Fill `out` with Exp(1) draws.

    NOTE: on CPU, `Tensor.exponential_` is about 3x slower than a uniform draw plus a log (it
    dominated the sampler's time), so CPU uses -log(u), u ~ U[0, 1): the same distribution.
    u = 0 gives q = inf, so that token's p/q is 0 and it cannot win; q is never 0 (no NaN).
    """
    if out.device.type == "cpu":
        out.uniform_(generator=generator).log_().neg_()
    else:
        out.exponential_(generator=generator)


def _gather_sample_logprobs(raw_logprobs: torch.Tensor,        # [num_rows, vocab]
                            sampled: torch.Tensor,             # [num_rows]
                            num_logprobs: tuple[int | None, ...],
                            max_k: int) -> list[Logprobs | None]:
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    row_index = torch.tensor(rows, dtype=torch.int64, device=raw_logprobs.device)
    row_logprobs = raw_logprobs.index_select(0, row_index)           # [num_asking, vocab]
    token_ids, values, ranks = _token_and_topk(row_logprobs, sampled.index_select(0, row_index), max_k)
    out: list[Logprobs | None] = [None] * len(num_logprobs)
    for j, i in enumerate(rows):
        k = num_logprobs[i]
        out[i] = Logprobs(token_ids=[token_ids[j][:k + 1]], logprobs=[values[j][:k + 1]],
                          ranks=[ranks[j]])
    return out


def _token_and_topk(logprobs: torch.Tensor,                    # [num_positions, vocab]
                    token_ids: torch.Tensor,                   # [num_positions] int64
                    k: int) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """Per position: [token, top1..topk] ids and logprobs, and the token's rank (1 = best)."""
    token_lp = logprobs.gather(1, token_ids.unsqueeze(1))            # [num_positions, 1]
    # Rank counts strictly better tokens, so ties share the best rank (as vLLM does).
    ranks = (logprobs > token_lp).sum(dim=-1) + 1                    # [num_positions]
    ids = token_ids.unsqueeze(1)
    values = token_lp
    k = min(k, logprobs.shape[-1])
    if k > 0:
        top_values, top_ids = logprobs.topk(k, dim=-1)               # [num_positions, k]
        ids = torch.cat([ids, top_ids], dim=1)
        values = torch.cat([values, top_values], dim=1)
    return ids.tolist(), values.tolist(), ranks.tolist()


def compute_prompt_logprobs(logits: torch.Tensor,              # [num_positions, vocab] float32
                            target_token_ids: torch.Tensor,    # [num_positions] int64
                            k: int) -> Logprobs:
    """Logprob, rank and top-k of the actual next prompt token at each position (raw logits)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids, values, ranks = _token_and_topk(logprobs, target_token_ids.to(torch.int64), k)
    return Logprobs(token_ids=ids, logprobs=values, ranks=ranks)

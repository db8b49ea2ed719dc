"""The timed runs behind `vbatch bench throughput`: one `generate` over N prompts, or batch-1 latency.

Called by cli/bench.py with an already-built `vbatch.LLM` (building it is not timed, as in
`vllm bench throughput`). Sampling follows vLLM's benchmark: temperature 1, top_p 1,
`ignore_eos`, `max_tokens = output_len`, so every request makes exactly `output_len` tokens.

NOTE: the prefill/decode split watches `engine.step` (wrapped for the run, then restored) and
the engine's `generation_tokens` counter: the prefill phase ends with the step in which the
last request got its first token; everything after is pure decode.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class ThroughputResult:
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    prefill_phase_s: float
    """From the start to the end of the step in which the last request got its first token."""
    decode_phase_s: float
    decode_phase_tokens: int
    """Output tokens made after the prefill phase (every running request decoding)."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return self.total_tokens / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.decode_phase_tokens / self.decode_phase_s if self.decode_phase_s > 0 else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(total_tokens=self.total_tokens, requests_per_s=self.requests_per_s,
                 total_tokens_per_s=self.total_tokens_per_s, output_tokens_per_s=self.output_tokens_per_s,
                 decode_tokens_per_s=self.decode_tokens_per_s,
                 # vLLM's `bench throughput --output-json` keys, for scripts written against it
                 elapsed_time=self.elapsed_s, total_num_tokens=self.total_tokens,
                 requests_per_second=self.requests_per_s, tokens_per_second=self.total_tokens_per_s)
        return d


@dataclass(frozen=True)
class LatencyResult:
    prompt_tokens: int
    output_tokens: int
    seconds: list[float] = field(default_factory=list)
    """One entry per timed iteration (a warm-up iteration runs first, untimed)."""
    decode_seconds: list[float] = field(default_factory=list)
    """Per iteration: first token to last token (output_tokens - 1 decode steps)."""

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.median_s

    @property
    def decode_tokens_per_s(self) -> float | None:
        med = statistics.median(self.decode_seconds) if self.decode_seconds else 0.0
        return (self.output_tokens - 1) / med if med > 0 else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(median_s=self.median_s, output_tokens_per_s=self.output_tokens_per_s,
                 decode_tokens_per_s=self.decode_tokens_per_s)
        return d


def bench_sampling_params(output_len: int):
    from ..engine.sampling_params import SamplingParams

    return SamplingParams(n=1, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)


@contextlib.contextmanager
def _step_trace(engine) -> Iterator[list[tuple[float, int]]]:
    """Record (monotonic end time, cumulative generation tokens) after every engine step."""
    trace: list[tuple[float, int]] = []
    original = engine.step

    def traced_step():
        finished = original()
        trace.append((time.monotonic(), engine.stats.generation_tokens))
        return finished

    engine.step = traced_step
    try:
        yield trace
    finally:
        del engine.step  # the instance attribute hid the method; removing it restores the original


def run_throughput(llm, prompts: Sequence[Sequence[int]], output_len: int) -> ThroughputResult:
    """Time one `llm.generate` over all prompts (token ids) and split it into prefill and decode phases."""
    requests = [{"prompt_token_ids": list(p)} for p in prompts]
    params = bench_sampling_params(output_len)
    engine = llm.engine
    tokens_before = engine.stats.generation_tokens
    with _step_trace(engine) as trace:
        start = time.monotonic()
        outputs = llm.generate(requests, params)
        end = time.monotonic()
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    assert output_tokens == output_len * len(prompts), "ignore_eos run made fewer tokens than asked"
    last_first_token = max(o.metrics.first_token_time or end for o in outputs)
    split_time, split_tokens = end, engine.stats.generation_tokens
    for t, cum in trace:
        if t >= last_first_token:
            split_time, split_tokens = t, cum
            break
    return ThroughputResult(
        num_requests=len(prompts), prompt_tokens=sum(len(p) for p in prompts), output_tokens=output_tokens,
        elapsed_s=end - start, prefill_phase_s=split_time - start, decode_phase_s=end - split_time,
        decode_phase_tokens=engine.stats.generation_tokens - split_tokens if trace else 0)


def run_latency(llm, prompt: Sequence[int], output_len: int, num_iters: int) -> LatencyResult:
    """Batch 1: generate `output_len` tokens for one prompt, once untimed, then `num_iters` times timed.

    Each iteration uses a fresh copy of the prompt, but prefix caching would still find it: the
    command turns prefix caching off for this mode so every iteration pays its prefill."""
    params = bench_sampling_params(output_len)
    request = {"prompt_token_ids": list(prompt)}
    llm.generate([request], params)  # warm-up
    seconds, decode_seconds = [], []
    for _ in range(num_iters):
        start = time.monotonic()
        out = llm.generate([request], params)[0]
        seconds.append(time.monotonic() - start)
        m = out.metrics
        if m.first_token_time is not None and m.last_token_time is not None:
            decode_seconds.append(m.last_token_time - m.first_token_time)
    return LatencyResult(prompt_tokens=len(prompt), output_tokens=output_len, seconds=seconds,
                         decode_seconds=decode_seconds)

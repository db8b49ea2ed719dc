"""Multi-step decodes (SchedulerConfig.num_scheduler_steps): the scheduler hands the runner several
forwards at once when every running request decodes plainly and nobody waits.

Oracles: for the scheduler, the same workload run one step at a time through a fake runner that
writes token ids into a fake paged KV cache (as tests/test_scheduler.py's) and reads back every
position a step attends; for the native steps, the engine's own single steps on the real model
(bit-identical kernels: the same tokens) and transformers' greedy `generate`
(tests/test_engine_equality.py).
"""
from __future__ import annotations

import random
import zlib

import pytest
import torch

from vbatch.engine.config import CacheConfig, SchedulerConfig
from vbatch.engine.request import Request, RequestStatus
from vbatch.engine.sampling_params import SamplingParams
from vbatch.engine.scheduler import Scheduler
from vbatch.engine.scheduler_output import ModelRunnerOutput

EOS, BS = 2, 4


def plain_request(rid: str, prompt: list[int], *, max_tokens: int, min_tokens: int = 0, greedy: bool = True,
                  stop_token_ids: list[int] | None = None) -> Request:
    params = SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=max_tokens, min_tokens=min_tokens,
                            stop_token_ids=stop_token_ids).resolve(eos_token_ids=[EOS], vocab_size=1000)
    return Request(rid, list(prompt), params, max_tokens=max_tokens)


class FakeStepsRunner:
    """Samples a deterministic token per (request, length); writes each fed token into its paged slot
    and checks that every position a forward attends reads back the request's token there. Runs a
    multi-step decode as the native one does: feeds back what it samples, ends with the first step in
    which a request sampled a stop token."""

    def __init__(self, num_blocks: int, seed: int):
        self.kv = [[None] * BS for _ in range(num_blocks)]
        self.seed = seed
        self.multi_steps = 0

    def token(self, rid: str, length: int) -> int:
        return zlib.crc32(f"{self.seed}/{rid}/{length}".encode()) % 30 + 1

    def _forward(self, block_ids, tokens: list[int], start: int, end: int) -> None:
        for p in range(start, end):
            self.kv[block_ids[p // BS]][p % BS] = tokens[p]
        assert [self.kv[block_ids[p // BS]][p % BS] for p in range(end)] == tokens[:end]

    def execute(self, out) -> ModelRunnerOutput:
        sampled = []
        if out.num_steps == 1:
            for s in out.scheduled:
                r = s.request
                self._forward(s.block_ids, r.all_token_ids, s.num_computed_tokens,
                              s.num_computed_tokens + s.num_new_tokens)
                sampled.append((self.token(r.request_id, r.num_tokens),) if s.will_sample else ())
        else:
            self.multi_steps += 1
            seqs = [list(s.request.all_token_ids) for s in out.scheduled]
            stopped = False
            for step in range(out.num_steps):
                for i, s in enumerate(out.scheduled):
                    assert s.num_new_tokens == 1 and s.request.sampling_params.is_plain
                    self._forward(s.block_ids, seqs[i], len(seqs[i]) - 1, len(seqs[i]))
                    token = self.token(s.request.request_id, len(seqs[i]))
                    seqs[i].append(token)
                    params = s.request.sampling_params
                    stopped |= token in params.all_stop_token_ids   # EOS and stop_token_ids
                if stopped:
                    break
            sampled = [tuple(seq[s.request.num_tokens:]) for seq, s in zip(seqs, out.scheduled)]
        return ModelRunnerOutput(req_ids=tuple(s.request.request_id for s in out.scheduled),
                                 sampled_token_ids=tuple(sampled))


def _workload(seed: int, num_steps: int, rows: int):
    rng = random.Random(seed)
    num_blocks, max_model_len = rng.randint(10, 40), 48
    config = SchedulerConfig(max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(8, 48),
                             max_model_len=max_model_len, num_scheduler_steps=num_steps)
    config.validate()
    sched = Scheduler(config, CacheConfig(block_size=BS, enable_prefix_caching=rng.random() < 0.5), num_blocks,
                      decode_steps_rows=rows)
    requests = []
    for i in range(rng.randint(3, 12)):
        prompt = [rng.randint(1, 30) for _ in range(rng.randint(1, 20))]
        max_tokens = rng.randint(1, max_model_len - len(prompt))
        requests.append(plain_request(f"r{i}", prompt, max_tokens=max_tokens,
                                      min_tokens=min(max_tokens, rng.choice([0, 0, 3])), greedy=rng.random() < 0.9,
                                      stop_token_ids=rng.choice([None, [5]])))
    return sched, requests, num_blocks


def _run(seed: int, num_steps: int, rows: int):
    sched, requests, num_blocks = _workload(seed, num_steps, rows)
    runner = FakeStepsRunner(num_blocks, seed)
    rng = random.Random(seed + 1000)
    pending = list(requests)
    for _ in range(3000):
        # requests arrive over time, so some multi-step decodes are cut short by a waiting request
        while pending and (not sched.has_unfinished_requests() or rng.random() < 0.1):
            sched.add_request(pending.pop(0))
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        if out.num_steps > 1:   # nobody could have been admitted instead
            assert (not sched.waiting or len(sched.running) == sched.config.max_num_seqs) and len(out.scheduled) <= rows
        sched.update_from_output(out, runner.execute(out))
        if out.num_steps > 1:  # every token but the last sampled one is in the cache now
            assert all(s.request.is_finished or s.request.num_tokens_to_compute == 1 for s in out.scheduled)
    assert not sched.has_unfinished_requests() and not pending
    bm = sched.block_manager
    assert bm.num_free_blocks == num_blocks - 1 and all(b.ref_cnt == 0 for b in bm.blocks)
    return [(r.output_token_ids, r.status) for r in requests], runner.multi_steps


def test_multi_step_decodes_give_the_single_steps_outputs():
    total = 0
    for seed in range(40):
        rows = 1 + seed % 4
        single, none = _run(seed, 1, rows)
        assert none == 0
        multi, used = _run(seed, 2 + seed % 7, rows)
        assert multi == single, seed
        total += used
    assert total > 50  # the seeds must exercise multi-step decodes


def test_a_multi_step_decode_stops_at_max_tokens_and_max_model_len():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=20, num_scheduler_steps=8)
    sched = Scheduler(config, CacheConfig(block_size=BS, enable_prefix_caching=False), 40, decode_steps_rows=4)
    a = plain_request("a", [9] * 10, max_tokens=5)       # 4 more tokens after the prefill's
    b = plain_request("b", [9] * 12, max_tokens=50)      # max_model_len 20: 7 more after the prefill's
    for r in (a, b):
        sched.add_request(r)
    runner = FakeStepsRunner(40, 0)
    runner.token = lambda rid, length: 7
    out = sched.schedule()
    assert out.num_steps == 1
    sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()
    assert out.num_steps == 4   # a's max_tokens bounds the step
    assert [len(s.block_ids) for s in out.scheduled] == [4, 4]   # slots for 14 / 16 tokens, allocated up front
    sched.update_from_output(out, runner.execute(out))
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 5
    out = sched.schedule()
    assert out.num_steps == 3 and b.num_tokens == 17   # max_model_len: 20 - 17
    sched.update_from_output(out, runner.execute(out))
    assert b.status == RequestStatus.FINISHED_LENGTH and b.num_tokens == 20


def _steps_until_done(sched, runner) -> list[tuple[str, int]]:
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps.append((",".join(s.request.request_id for s in out.scheduled), out.num_steps))
        sched.update_from_output(out, runner.execute(out))
    return steps


def test_multi_step_decodes_only_for_plain_requests_and_only_when_no_waiting_one_has_room():
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64, num_scheduler_steps=8)
    sched = Scheduler(config, CacheConfig(block_size=BS, enable_prefix_caching=False), 40, decode_steps_rows=4)
    runner = FakeStepsRunner(40, 0)
    runner.token = lambda rid, length: 7
    logprobs = Request("lp", [3, 4], SamplingParams(temperature=0.0, logprobs=1, max_tokens=9).resolve(
        eos_token_ids=[EOS], vocab_size=1000), max_tokens=9)
    stop_string = Request("ss", [3, 4], SamplingParams(temperature=0.0, stop=["x"], max_tokens=9).resolve(
        eos_token_ids=[EOS], vocab_size=1000), max_tokens=9)
    for r in (plain_request("p", [3, 4], max_tokens=9, min_tokens=4), logprobs, stop_string):
        sched.add_request(r)
    # max_num_seqs 1: "p" runs with the others waiting, without room; its single steps until
    # min_tokens is met (the prefill's token, then 3), then its last 5 tokens in one step. The other
    # two are not plain (logprobs read the logits; a stop string needs the text).
    assert _steps_until_done(sched, runner) == [("p", 1)] * 4 + [("p", 5)] + [("lp", 1)] * 9 + [("ss", 1)] * 9
    # A waiting request with room is admitted first: "a" decodes alone, "b" arrives.
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, num_scheduler_steps=8)
    sched = Scheduler(config, CacheConfig(block_size=BS, enable_prefix_caching=False), 40, decode_steps_rows=4)
    sched.add_request(plain_request("a", [3, 4], max_tokens=20))
    sched.update_from_output(out := sched.schedule(), runner.execute(out))
    sched.add_request(plain_request("b", [5, 6], max_tokens=3))
    out = sched.schedule()
    assert out.num_steps == 1 and [s.request.request_id for s in out.scheduled] == ["a", "b"]
    sched.update_from_output(out, runner.execute(out))
    # a 2 tokens and b 1: then both together until b's length (2 more), then a alone
    assert _steps_until_done(sched, runner) == [("a,b", 2), ("a", 8), ("a", 8)]


# ---------------------------------------------------------------------------- the real model, natively

@pytest.mark.slow
def test_native_multi_step_decodes_give_the_single_steps_tokens(smollm2_path):
    from vbatch import LLM
    llm = LLM(str(smollm2_path), dtype="float32", device="cpu", quiet=True, max_num_seqs=4)
    engine = llm.engine
    if engine.scheduler.decode_steps_rows == 0:
        pytest.skip("no native kernels on this machine (the multi-step decode is native only)")
    assert engine.scheduler.num_decode_steps == 8 and engine.scheduler.decode_steps_rows == 4
    prompts = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
               "def add(a, b):", "Once upon a time"]
    cases = [SamplingParams(temperature=0.0, max_tokens=29),                          # stops at EOS or length
             SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=40, min_tokens=5, stop_token_ids=[13, 29]),
             # random draws from the engine's generator, then from a request's own; "." and "," stop them
             SamplingParams(temperature=0.8, max_tokens=21, stop_token_ids=[30, 28]),
             SamplingParams(temperature=1.0, max_tokens=25, seed=7, stop_token_ids=[30])]
    seen, used = set(), []
    for params in cases:
        # the last group: 4 running (max_num_seqs) while the fifth waits without room
        for group in (prompts[:1], prompts[1:3], prompts[1:5], prompts):
            engine.scheduler.num_decode_steps = 1
            engine.runner.generator.manual_seed(11)
            single = [o.outputs[0] for o in llm.generate(group, params)]
            after_single = engine.runner.generator.get_state()
            engine.scheduler.num_decode_steps = 8
            engine.runner.generator.manual_seed(11)
            before = engine.stats.num_steps
            multi = [o.outputs[0] for o in llm.generate(group, params)]
            # the engine's generator is where single steps leave it, even when the steps stopped early
            assert torch.equal(engine.runner.generator.get_state(), after_single)
            assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in multi] == \
                   [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in single], (params, group)
            seen.update((o.finish_reason, o.stop_reason) for o in multi)
            # single steps give a request at most one token each: fewer steps than its tokens took several
            used.append(engine.stats.num_steps - before < max(len(o.token_ids) for o in multi))
    assert sum(used) >= len(used) - 2, used
    # the cases must end requests every way a multi-step decode can: EOS, a stop token, length
    assert {("stop", None), ("length", None)} <= seen and {29, 30} & {r for _, r in seen}, seen

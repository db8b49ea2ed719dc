"""Scheduler: pure Python with fake requests and hand-built runner outputs.

The randomised test runs a fake runner that writes token ids into a fake paged KV cache through
the scheduled block tables and checks every attended position reads back the right token:
an independent oracle for block tables, prefix-cache hits, eviction and preemption.
"""
from __future__ import annotations

import random
import zlib

from vbatch.engine.block_manager import NULL_BLOCK_ID
from vbatch.engine.config import CacheConfig, SchedulerConfig
from vbatch.engine.request import Request, RequestStatus
from vbatch.engine.sampling_params import SamplingParams
from vbatch.engine.scheduler import Scheduler
from vbatch.engine.scheduler_output import Logprobs, ModelRunnerOutput

EOS = 2
BS = 4


def make_request(rid: str, prompt: list[int] | int, *, max_tokens: int = 16, min_tokens: int = 0,
                 stop_token_ids: list[int] | None = None, ignore_eos: bool = False, salt: str | None = None,
                 pooling: bool = False) -> Request:
    if isinstance(prompt, int):
        prompt = [100 + (zlib.crc32(rid.encode()) % 50) + i for i in range(prompt)]
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=stop_token_ids,
                            ignore_eos=ignore_eos).resolve(eos_token_ids=[EOS], vocab_size=1000)
    return Request(rid, list(prompt), params, max_tokens=max_tokens, cache_salt=salt,
                   pooling_params=object() if pooling else None)


def make_scheduler(*, num_blocks: int = 100, budget: int = 64, max_num_seqs: int = 16, chunked: bool = True,
                   max_model_len: int = 128, prefix_caching: bool = True) -> Scheduler:
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         enable_chunked_prefill=chunked, max_model_len=max_model_len)
    sc.validate()
    return Scheduler(sc, CacheConfig(block_size=BS, enable_prefix_caching=prefix_caching), num_blocks)


def runner_output(out, token_for=lambda req: 7, **extra) -> ModelRunnerOutput:
    """A runner that samples `token_for(request)` for every request that reaches its last token."""
    sampled = tuple((token_for(s.request),) if s.will_sample else () for s in out.scheduled)
    return ModelRunnerOutput(req_ids=tuple(s.request.request_id for s in out.scheduled),
                             sampled_token_ids=sampled, **extra)


def step(sched: Scheduler, token_for=lambda req: 7):
    out = sched.schedule()
    updates = sched.update_from_output(out, runner_output(out, token_for))
    return out, {u.request_id: u for u in updates}


def new_tokens(out) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def run_to_end(sched: Scheduler, token_for=lambda req: 7, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        step(sched, token_for)
    raise AssertionError("requests did not finish")


# ---------------------------------------------------------------------------- budget and chunking
def test_budget_is_split_between_decodes_and_a_new_prefill():
    sched = make_scheduler(budget=10)
    sched.add_request(make_request("a", 3))
    sched.add_request(make_request("b", 3))
    out, updates = step(sched)
    assert new_tokens(out) == {"a": 3, "b": 3} and out.num_scheduled_tokens == 6
    assert updates["a"].new_token_ids == (7,) and updates["b"].new_token_ids == (7,)
    sched.add_request(make_request("c", 20))
    out, updates = step(sched)
    assert new_tokens(out) == {"a": 1, "b": 1, "c": 8} and out.num_scheduled_tokens == 10
    assert [s.will_sample for s in out.scheduled] == [True, True, False]
    assert "c" not in updates


def test_long_prompt_is_chunked_and_samples_only_after_the_last_chunk():
    sched = make_scheduler(budget=8)
    req = make_request("a", 21, max_tokens=2)
    sched.add_request(req)
    seen = []
    for _ in range(3):
        out = sched.schedule()
        (s,) = out.scheduled
        seen.append((s.num_computed_tokens, s.num_new_tokens, s.will_sample))
        sched.update_from_output(out, runner_output(out))
    assert seen == [(0, 8, False), (8, 8, False), (16, 5, True)]
    assert req.num_computed_tokens == 21 and req.output_token_ids == [7]
    out, updates = step(sched)
    assert new_tokens(out) == {"a": 1} and updates["a"].finish_reason == "length"


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits_whole():
    sched = make_scheduler(budget=32, max_model_len=32, chunked=False)
    for rid, n in (("a", 20), ("b", 16), ("c", 2)):
        sched.add_request(make_request(rid, n, max_tokens=4))
    out, _ = step(sched)
    assert new_tokens(out) == {"a": 20}                 # b (16 > 12 left) waits, and c behind it
    out, _ = step(sched)
    assert new_tokens(out) == {"a": 1, "b": 16, "c": 2}
    # The same with chunking on: b takes the 12 tokens left.
    chunked = make_scheduler(budget=32, max_model_len=32, chunked=True)
    for rid, n in (("a", 20), ("b", 16), ("c", 2)):
        chunked.add_request(make_request(rid, n, max_tokens=4))
    assert new_tokens(chunked.schedule()) == {"a": 20, "b": 12}


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_request("a", 4, max_tokens=1))
    sched.add_request(make_request("b", 4, max_tokens=3))
    sched.add_request(make_request("c", 4, max_tokens=1))
    out, updates = step(sched)
    assert new_tokens(out) == {"a": 4, "b": 4} and updates["a"].finish_reason == "length"
    out, _ = step(sched)
    assert new_tokens(out) == {"b": 1, "c": 4}
    assert out.finished_request_ids == ("a",)


# ---------------------------------------------------------------------------- preemption
def test_newest_running_request_is_preempted_and_later_resumes():
    # 4 usable blocks of 4 tokens; two 6-token prompts take 2 blocks each.
    sched = make_scheduler(num_blocks=5, max_model_len=16, prefix_caching=False)
    a, b = make_request("a", 6, max_tokens=5), make_request("b", 6, max_tokens=5)
    c = make_request("c", 1, max_tokens=1)
    for r in (a, b):
        sched.add_request(r)
    for _ in range(3):                                   # tokens 6, 7, 8 fill both second blocks
        out, _ = step(sched)
        assert set(new_tokens(out)) == {"a", "b"}
    sched.add_request(c)
    out, _ = step(sched)                                 # a needs a third block: b goes
    assert new_tokens(out) == {"a": 1} and out.preempted_request_ids == ("b",)
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert list(sched.waiting) == [b, c]                 # front of the queue, ahead of c
    assert sched.num_preemptions_total == 1
    assert b.output_token_ids == [7, 7, 7]               # sampled tokens are kept
    out, updates = step(sched)                           # a finishes (5 outputs) ...
    assert updates["a"].finish_reason == "length"
    out, updates = step(sched)                           # ... and b recomputes all 9 known tokens
    assert new_tokens(out)["b"] == 9 and out.scheduled[0].will_sample
    run_to_end(sched)
    assert b.output_token_ids == [7] * 5 and b.status == RequestStatus.FINISHED_LENGTH
    assert sched.block_manager.num_free_blocks == 4


def test_a_request_can_preempt_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=4, max_model_len=12, prefix_caching=False)    # 3 usable blocks
    a, b = make_request("a", 3, max_tokens=3), make_request("b", 8, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)                                 # a: 1 block, b: 2 blocks; the pool is full
    assert new_tokens(out) == {"a": 3, "b": 8}
    out, _ = step(sched)                                 # a fits its block; b (the newest) needs a 3rd
    assert new_tokens(out) == {"a": 1} and out.preempted_request_ids == ("b",)
    assert b.status == RequestStatus.PREEMPTED and list(sched.waiting) == [b]
    run_to_end(sched)
    assert a.num_output_tokens == b.num_output_tokens == 3 and b.num_preemptions == 1


# ---------------------------------------------------------------------------- prefix caching
def test_second_request_hits_the_full_block_prefix():
    sched = make_scheduler()
    shared = list(range(10, 20))                         # 10 tokens: 2 full blocks
    sched.add_request(make_request("a", shared, max_tokens=1))
    step(sched)                                          # a finishes, blocks freed but cached
    b = make_request("b", shared + [55, 56, 57], max_tokens=1)
    sched.add_request(b)
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.num_computed_tokens, s.num_new_tokens) == (8, 5) and b.num_cached_tokens == 8
    updates = sched.update_from_output(out, runner_output(out))
    assert updates[0].num_cached_tokens == 8
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (10 + 13, 8)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched = make_scheduler()
    prompt = list(range(10, 18))                         # exactly 2 blocks
    sched.add_request(make_request("a", prompt, max_tokens=1))
    step(sched)
    sched.add_request(make_request("b", prompt, max_tokens=1))
    out = sched.schedule()
    (s,) = out.scheduled
    # (8 - 1) // 4 = 1 block may hit: 4 tokens recomputed, and the step samples.
    assert (s.num_computed_tokens, s.num_new_tokens, s.will_sample) == (4, 4, True)


def test_cached_blocks_are_evicted_when_the_pool_needs_them():
    sched = make_scheduler(num_blocks=4, max_model_len=12)   # 3 usable blocks
    prompt = list(range(10, 19))                         # 9 tokens: 3 blocks
    sched.add_request(make_request("a", prompt, max_tokens=1))
    step(sched)
    sched.add_request(make_request("big", [500 + i for i in range(11)], max_tokens=1))   # 11 tokens: 3 blocks
    step(sched)                                          # takes all 3 blocks: a's are evicted
    b = make_request("b", prompt, max_tokens=1)
    sched.add_request(b)
    step(sched)
    assert b.num_cached_tokens == 0


def test_salted_siblings_share_in_the_same_step_even_with_caching_off():
    sched = make_scheduler(prefix_caching=False)
    prompt = list(range(10, 19))                         # 9 tokens
    s1, s2 = make_request("s1", prompt, salt="p1"), make_request("s2", prompt, salt="p1")
    other = make_request("u", prompt)
    for r in (s1, s2, other):
        sched.add_request(r)
    out = sched.schedule()
    assert new_tokens(out) == {"s1": 9, "s2": 1, "u": 9}
    assert (s1.num_cached_tokens, s2.num_cached_tokens, other.num_cached_tokens) == (0, 8, 0)
    ids1, ids2 = sched.block_manager.get_block_ids("s1"), sched.block_manager.get_block_ids("s2")
    assert ids1[:2] == ids2[:2] and ids1[2] != ids2[2]
    assert not set(sched.block_manager.get_block_ids("u")) & set(ids1)
    sched.update_from_output(out, runner_output(out))
    blocks = sched.block_manager.blocks
    assert [blocks[i].ref_cnt for i in ids1[:2]] == [2, 2]
    sched.finish_requests("s1", RequestStatus.FINISHED_ABORTED)
    assert [blocks[i].ref_cnt for i in ids1[:2]] == [1, 1]
    sched.finish_requests(["s2"], RequestStatus.FINISHED_ABORTED)
    assert [blocks[i].ref_cnt for i in ids1[:2]] == [0, 0]


def test_salted_request_does_not_share_with_unsalted():
    sched = make_scheduler()
    prompt = list(range(10, 19))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    step(sched)
    s = make_request("s", prompt, salt="secret", max_tokens=1)
    sched.add_request(s)
    step(sched)
    assert s.num_cached_tokens == 0


# ---------------------------------------------------------------------------- stops
def finish_with(tokens: list[int], **kw):
    sched = make_scheduler(max_model_len=kw.pop("max_model_len", 128))
    req = make_request("r", 3, **kw)
    sched.add_request(req)
    it = iter(tokens)
    last = None
    while sched.has_unfinished_requests():
        _, updates = step(sched, lambda r: next(it))
        last = updates.get("r", last)
    return req, last


def test_eos_stops_with_no_stop_reason():
    req, last = finish_with([5, EOS, 9])
    assert req.output_token_ids == [5, EOS] and last.finish_reason == "stop" and last.stop_reason is None


def test_stop_token_id_names_itself():
    req, last = finish_with([5, 50, 9], stop_token_ids=[50])
    assert req.output_token_ids == [5, 50] and (last.finish_reason, last.stop_reason) == ("stop", 50)


def test_min_tokens_defers_stops_and_ignore_eos_disables_eos():
    req, last = finish_with([EOS, EOS, EOS, 4], min_tokens=3)
    assert req.output_token_ids == [EOS, EOS, EOS] and last.finish_reason == "stop"
    req, last = finish_with([EOS, EOS, EOS], ignore_eos=True, max_tokens=3)
    assert req.output_token_ids == [EOS] * 3 and last.finish_reason == "length"


def test_max_tokens_and_max_model_len_finish_with_length():
    req, last = finish_with([5] * 10, max_tokens=4)
    assert req.num_output_tokens == 4 and last.finish_reason == "length"
    req, last = finish_with([5] * 10, max_tokens=100, max_model_len=6)   # prompt 3 + 3 outputs
    assert req.num_tokens == 6 and last.finish_reason == "length"
    assert last.new_token_ids == (5,) and req.first_token_time <= req.last_token_time


# ---------------------------------------------------------------------------- outside finishes, outputs
def test_finish_requests_aborts_running_and_waiting_and_ignores_unknown_ids():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 5), make_request("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    sched.finish_requests(["a", "b", "nope"], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)          # already finished: ignored
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests() and sched.get_num_unfinished_requests() == 0
    assert sched.block_manager.num_free_blocks == 99
    out = sched.schedule()
    assert out.is_empty and set(out.finished_request_ids) == {"a", "b"}
    assert sched.schedule().finished_request_ids == ()


def test_abort_between_schedule_and_update_is_skipped():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5))
    out = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, runner_output(out)) == []


def test_logprobs_pass_through_and_partial_chunks_report_prompt_logprobs():
    sched = make_scheduler(budget=4)
    sched.add_request(make_request("a", 6))
    out = sched.schedule()
    plp = Logprobs(token_ids=[[1], [2], [3], [4]], logprobs=[[-1.0]] * 4, ranks=[1] * 4)
    updates = sched.update_from_output(out, runner_output(out, prompt_logprobs=(plp,), logprobs=(None,)))
    assert len(updates) == 1 and updates[0].new_prompt_logprobs is plp and updates[0].new_token_ids == ()
    out = sched.schedule()
    lp = Logprobs(token_ids=[[7]], logprobs=[[-0.5]], ranks=[1])
    (u,) = sched.update_from_output(out, runner_output(out, logprobs=(lp,)))
    assert u.new_logprobs is lp and u.new_token_ids == (7,)


def test_pooling_request_runs_its_prompt_once_and_finishes():
    sched = make_scheduler(budget=8)
    req = make_request("e", 6, pooling=True)
    sched.add_request(make_request("long", 7))
    sched.add_request(req)
    out = sched.schedule()
    assert new_tokens(out) == {"long": 7}                # pooling prompts are never chunked
    sched.update_from_output(out, runner_output(out))
    out, updates = step(sched)
    assert new_tokens(out) == {"long": 1, "e": 6} and not out.scheduled[1].will_sample
    assert updates["e"].finish_reason == "stop" and req.output_token_ids == []


# ---------------------------------------------------------------------------- randomised
class FakeKVRunner:
    """Writes each token id into its paged slot, then checks every attended position reads back right."""

    def __init__(self, num_blocks: int, seed: int):
        self.kv = [[None] * BS for _ in range(num_blocks)]
        self.seed = seed

    def token(self, req: Request) -> int:
        # Deterministic per (request, position): the oracle can recompute the whole output.
        return zlib.crc32(f"{self.seed}/{req.request_id}/{req.num_tokens}".encode()) % 40 + 1

    def execute(self, out) -> ModelRunnerOutput:
        for s in out.scheduled:
            assert NULL_BLOCK_ID not in s.block_ids and s.num_new_tokens > 0
            start = s.num_computed_tokens
            for p in range(start, start + s.num_new_tokens):
                self.kv[s.block_ids[p // BS]][p % BS] = s.request.all_token_ids[p]
        for s in out.scheduled:
            end = s.num_computed_tokens + s.num_new_tokens
            read = [self.kv[s.block_ids[p // BS]][p % BS] for p in range(end)]
            assert read == s.request.all_token_ids[:end], s.request
        return runner_output(out, self.token)


def expected_output(runner: FakeKVRunner, req: Request, max_model_len: int) -> list[int]:
    probe = make_request(req.request_id, req.prompt_token_ids, max_tokens=req.max_tokens)
    out: list[int] = []
    while True:
        tok = runner.token(probe)
        out.append(tok)
        probe.append_output_token(tok)
        if tok == EOS or len(out) >= req.max_tokens or probe.num_tokens >= max_model_len:
            return out


def test_random_workload_finishes_everything_and_frees_every_block():
    total_preemptions = total_hits = 0
    for seed in range(12):
        rng = random.Random(seed)
        num_blocks, max_model_len = rng.randint(12, 30), 40
        chunked = rng.random() < 0.7
        sched = make_scheduler(num_blocks=num_blocks, max_model_len=max_model_len, chunked=chunked,
                               budget=rng.randint(8, 48) if chunked else max_model_len + rng.randint(0, 8),
                               max_num_seqs=rng.randint(1, 8), prefix_caching=rng.random() < 0.7)
        runner = FakeKVRunner(num_blocks, seed)
        prefixes = [[rng.randint(1, 40) for _ in range(rng.randint(0, 12))] for _ in range(3)]
        requests = []
        for i in range(rng.randint(10, 30)):
            prompt = (rng.choice(prefixes) + [rng.randint(1, 40) for _ in range(rng.randint(1, 20))])[:30]
            req = make_request(f"r{i}", prompt, max_tokens=rng.randint(1, max_model_len - len(prompt)),
                               salt=rng.choice([None, None, "s"]))
            requests.append(req)
            sched.add_request(req)
        for _ in range(2000):
            if not sched.has_unfinished_requests():
                break
            if rng.random() < 0.02:
                sched.finish_requests(rng.choice(requests).request_id, RequestStatus.FINISHED_ABORTED)
            out = sched.schedule()
            assert out.num_scheduled_tokens <= sched.config.max_num_batched_tokens
            assert len(sched.running) <= sched.config.max_num_seqs
            sched.update_from_output(out, runner.execute(out))
        bm = sched.block_manager
        assert not sched.has_unfinished_requests()
        assert bm.num_free_blocks == num_blocks - 1 and all(b.ref_cnt == 0 for b in bm.blocks)
        for req in requests:
            assert req.is_finished
            if req.status != RequestStatus.FINISHED_ABORTED:
                assert req.output_token_ids == expected_output(runner, req, max_model_len), req
        total_preemptions += sched.num_preemptions_total
        total_hits += sched.prefix_cache_hits
    # The seeds must exercise what the test is for.
    assert total_preemptions > 0 and total_hits > 0

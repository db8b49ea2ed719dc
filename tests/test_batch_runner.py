"""run_batch ordering, bounding and error records, against a test double of the engine interface.

FakeLLM below is a TEST DOUBLE of `batch/jobs.BatchLLM`, the interface the runner relies on
(get_default_sampling_params, preprocess_chat, stream, stats). Its `stream` is the real streaming
results API (engine/output_stream.stream_outputs) over FakeEngine, a double of the engine's step
primitives (add_request/step/abort_request/has_unfinished_requests) that generates nothing real: a
request "finishes" after `max_tokens` steps, which lets the tests choose the order in which requests
finish. Generation itself is tested with the real model elsewhere.
"""
from __future__ import annotations

from vbatch.batch.reorder import ReorderWindow
from vbatch.batch.record import BatchRecord, RecordError
from vbatch.batch.runner import run_batch
from vbatch.engine.errors import InputError
from vbatch.engine.llm_engine import EngineStats
from vbatch.engine.output_stream import stream_outputs
from vbatch.engine.outputs import CompletionOutput, RequestOutput
from vbatch.engine.sampling_params import SamplingParams


class FakeEngine:
    def __init__(self):
        self.running = {}      # request_id -> [steps left, prompt, params]
        self.added = []        # (request_id, prompt, params) in add order
        self.max_running = 0
        self.stats = EngineStats()
        self.on_add = None
        self.aborted = []

    def add_request(self, request_id, prompt, params, *, pooling_task=None):
        if prompt.get("prompt") == "too long":
            raise InputError("the prompt is 9999 tokens; max_model_len is 2048", field="prompt")
        self.added.append((request_id, prompt, params))
        self.running[request_id] = [params.max_tokens, prompt, params]
        self.max_running = max(self.max_running, len(self.running))
        self.stats.prefix_cache_queries += 4
        self.stats.prefix_cache_hits += 1
        if self.on_add:
            self.on_add()

    def has_unfinished_requests(self):
        return bool(self.running)

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        self.running.pop(request_id, None)

    def step(self):
        done = []
        for rid in list(self.running):
            state = self.running[rid]
            state[0] -= 1
            if state[0] == 0:
                _, prompt, params = self.running.pop(rid)
                ids = prompt.get("prompt_token_ids") or [1, 2]
                done.append(RequestOutput(
                    request_id=rid, prompt=prompt.get("prompt"), prompt_token_ids=list(ids), prompt_logprobs=None,
                    outputs=[CompletionOutput(index=0, text="x" * params.max_tokens, token_ids=[7] * params.max_tokens,
                                              cumulative_logprob=None, logprobs=None, finish_reason="length")],
                    finished=True, num_cached_tokens=1))
        self.stats.num_preemptions += 1 if done else 0
        return done


class FakeLLM:
    """Test double of vbatch.LLM (see the module docstring)."""

    is_pooling_model = False

    def __init__(self):
        self.engine = FakeEngine()

    def get_default_sampling_params(self):
        return SamplingParams(temperature=0.5, top_p=0.9)  # stands in for generation_config defaults

    def preprocess_chat(self, messages, *, chat_template=None, add_generation_prompt=True,
                        continue_final_message=False):
        text = (chat_template or "") + "|".join(m["content"] for m in messages)
        return {"prompt": text, "prompt_token_ids": [3] * len(messages)}

    def stream(self, requests, *, max_in_flight=None, admit=None, should_stop=None):
        return stream_outputs(self.engine, requests, max_in_flight=max_in_flight, admit=admit,
                              should_stop=should_stop)

    @property
    def stats(self):
        return self.engine.stats


class ListWriter:
    path = "<memory>"

    def __init__(self):
        self.results = []

    def write(self, result):
        self.results.append(result)

    def close(self):
        pass

    def abort(self):
        pass


def rec(i, max_tokens, **kw):
    return BatchRecord(id=f"r{i}", line=i + 1, kind="prompt", prompt=f"p{i}",
                       sampling_overrides={"max_tokens": max_tokens, **kw})


def test_reorder_window_releases_in_order():
    w = ReorderWindow()
    w.put(2, "c")
    w.put(1, "b")
    assert w.pop_ready() == [] and w.num_held == 2
    w.put(0, "a")
    assert w.pop_ready() == ["a", "b", "c"] and w.num_held == 0
    w.put(3, "d")
    assert w.pop_ready() == ["d"]


def test_out_of_order_finishes_are_written_in_input_order():
    llm, writer = FakeLLM(), ListWriter()
    steps = [5, 1, 3, 1, 2, 4]
    summary = run_batch([rec(i, s) for i, s in enumerate(steps)], writer, llm, {}, max_in_flight=8)
    assert [r.id for r in writer.results] == [f"r{i}" for i in range(6)]
    assert [r.seq for r in writer.results] == list(range(6))
    assert [len(r.output.outputs[0].token_ids) for r in writer.results] == steps
    assert summary.num_requests == 6 and summary.num_ok == 6 and summary.num_errors == 0
    assert summary.generated_tokens == sum(steps) and summary.prompt_tokens == 2 * 6
    assert summary.cached_prompt_tokens == 6
    assert summary.prefix_cache_hit_rate == 0.25
    assert summary.num_preemptions > 0


def test_in_flight_and_unwritten_records_are_bounded():
    llm, writer = FakeLLM(), ListWriter()
    unwritten = []
    llm.engine.on_add = lambda: unwritten.append(len(llm.engine.added) - len(writer.results))
    # A slow first record (20 steps) holds back 30 fast ones behind it in the reorder window.
    records = [rec(0, 20)] + [rec(i, 1) for i in range(1, 31)]
    run_batch(records, writer, llm, {}, max_in_flight=3, max_pending=6)
    assert llm.engine.max_running <= 3
    assert max(unwritten) <= 6
    assert [r.id for r in writer.results] == [f"r{i}" for i in range(31)]


def test_bad_records_and_refused_requests_become_error_results_in_place():
    llm, writer = FakeLLM(), ListWriter()
    bad = RecordError(id=None, line=2, field="json", message="invalid JSON: x", file="in.jsonl")
    refused = BatchRecord(id="long", line=3, kind="prompt", prompt="too long")
    summary = run_batch([rec(0, 2), bad, refused, rec(3, 1)], writer, llm, {}, max_in_flight=4)
    assert [r.ok for r in writer.results] == [True, False, False, True]
    assert writer.results[1].error_message == "in.jsonl:2: json: invalid JSON: x"
    assert writer.results[2].error_message == "prompt: the prompt is 9999 tokens; max_model_len is 2048"
    assert writer.results[2].id == "long"
    assert summary.num_errors == 2 and summary.num_ok == 2


def test_sampling_precedence_record_over_command_line_over_model():
    llm, writer = FakeLLM(), ListWriter()
    chat = BatchRecord(id="c", line=2, kind="messages", messages=[{"role": "user", "content": "hi"}],
                       sampling_overrides={"temperature": 0.0})
    run_batch([rec(0, 1), chat], writer, llm, {"temperature": 1.2, "max_tokens": 2}, max_in_flight=4,
              chat_template="T:")
    (_, p0, params0), (_, p1, params1) = llm.engine.added
    assert (params0.temperature, params0.max_tokens, params0.top_p) == (1.2, 1, 0.9)  # record max_tokens wins
    assert (params1.temperature, params1.max_tokens) == (0.0, 2)  # record temperature; command-line max_tokens
    assert p1 == {"prompt": "T:hi", "prompt_token_ids": [3]}
    assert p0 == {"prompt": "p0"}


def test_empty_input():
    summary = run_batch([], ListWriter(), FakeLLM(), {}, max_in_flight=2)
    assert summary.num_requests == 0 and summary.prefix_cache_hit_rate is None


def test_a_stop_request_drops_what_is_in_flight_and_writes_what_is_ready():
    llm, writer = FakeLLM(), ListWriter()
    polls = []

    def should_stop():
        polls.append(1)
        return len(polls) > 3
    summary = run_batch([rec(0, 1), rec(1, 50), rec(2, 1), rec(3, 50)], writer, llm, {}, max_in_flight=4,
                        should_stop=should_stop)
    assert summary.interrupted
    assert [r.id for r in writer.results] == ["r0"]           # r2 finished but waits behind r1
    assert sorted(llm.engine.aborted) == ["1", "3"] and not llm.engine.running


def test_a_record_of_several_requests_waits_for_all_and_fails_as_one():
    class ThreeEach:
        """A job that makes three requests per record (as an embeddings line with three inputs)."""

        def requests_for(self, record):
            steps = record.sampling_overrides["max_tokens"]
            prompts = [{"prompt": "too long"} if record.id == "bad" and k == 1 else {"prompt": f"{record.id}.{k}"}
                       for k in range(3)]
            return [(p, SamplingParams(max_tokens=steps + 2 - k), None) for k, p in enumerate(prompts)]
    llm, writer = FakeLLM(), ListWriter()
    records = [BatchRecord(id=rid, line=i + 1, kind="prompt", prompt="x", sampling_overrides={"max_tokens": steps},
                           inputs=("a", "b", "c")) for i, (rid, steps) in enumerate((("r0", 3), ("bad", 1), ("r2", 1)))]
    summary = run_batch(records, writer, llm, max_in_flight=4, job=ThreeEach())
    assert [r.id for r in writer.results] == ["r0", "bad", "r2"]
    first = writer.results[0]
    assert [len(o.outputs[0].token_ids) for o in first.output] == [5, 4, 3]     # in input order, not finish order
    assert [o.prompt for o in first.output] == ["r0.0", "r0.1", "r0.2"]
    assert writer.results[1].error_message.startswith("prompt: the prompt is 9999 tokens")
    assert summary.num_ok == 2 and summary.num_errors == 1
    assert {rid for rid, _, _ in llm.engine.added} >= {"0.0", "0.1", "0.2", "2.0"}

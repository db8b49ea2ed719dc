"""The engine's request kinds and its streaming results API, pure Python, through a fake model runner.

FakePoolingRunner is a TEST DOUBLE of the runner contract (`runs_pooling`, `needs_kv_cache`,
`initialize_kv_cache`, `model_info`, `execute_model`): each request's "embedding" is
[sum of its token ids, its length], so the tests can tell every result apart. The real encoder
is tested against transformers in test_pooling_models.py.
"""
from __future__ import annotations

import pytest
import torch

from vbatch.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from vbatch.engine.errors import InputError, PoolingParamsError, UnsupportedTaskError
from vbatch.engine.llm_engine import LLMEngine
from vbatch.engine.output_stream import EngineRequest
from vbatch.engine.pooling_params import PoolingModelInfo, PoolingParams
from vbatch.engine.sampling_params import SamplingParams
from vbatch.engine.scheduler_output import ModelRunnerOutput


class WordTokenizer:
    """Test double: one token per word, its length as the id (plus 100 = 'CLS')."""

    eos_token_id = None

    def encode(self, text, truncation=False, max_length=None, add_special_tokens=True):
        ids = [100] + [len(w) for w in text.split()]
        return ids[:max_length] if truncation else ids


class FakePoolingRunner:
    runs_pooling = True
    needs_kv_cache = False

    def __init__(self, fail_at_step=None):
        self.steps: list[tuple[str, ...]] = []
        self.fail_at_step = fail_at_step

    def initialize_kv_cache(self):
        return 0

    def model_info(self, name):
        return PoolingModelInfo(name=name, supported_tasks=("embed", "token_embed"), hidden_size=2)

    def execute_model(self, sched):
        self.steps.append(tuple(s.request.request_id for s in sched.scheduled))
        if self.fail_at_step == len(self.steps):
            raise RuntimeError("the model crashed")
        for s in sched.scheduled:   # pooling runs whole prompts, never chunks
            assert s.num_new_tokens == s.request.num_prompt_tokens and s.block_ids == ()
        outs = tuple(torch.tensor([float(sum(s.request.prompt_token_ids)), float(s.request.num_prompt_tokens)])
                     for s in sched.scheduled)
        return ModelRunnerOutput(req_ids=tuple(s.request.request_id for s in sched.scheduled),
                                 sampled_token_ids=tuple(() for _ in sched.scheduled), pooler_outputs=outs)


def make_engine(runner=None, *, max_model_len=8, max_num_seqs=3, budget=20):
    config = EngineConfig(ModelConfig(model="fake", max_model_len=max_model_len), CacheConfig(),
                          SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                          max_model_len=max_model_len))
    return LLMEngine.with_runner(config, runner or FakePoolingRunner(), WordTokenizer(), vocab_size=1000,
                                 model_name="fake-encoder")


def run_all(engine):
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    return done


def test_pooling_requests_run_whole_and_finish_with_the_pooler_output():
    engine = make_engine()
    engine.add_request("a", "one two three", PoolingParams(), pooling_task="embed")
    engine.add_request("b", {"prompt_token_ids": [5, 6]}, PoolingParams(task="embed"))
    done = run_all(engine)
    assert done["a"].outputs.data.tolist() == [100 + 3 + 3 + 5, 4.0]
    assert done["b"].outputs.data.tolist() == [11.0, 2.0] and done["b"].prompt_token_ids == [5, 6]
    assert done["a"].prompt == "one two three"
    assert engine.scheduler.get_num_unfinished_requests() == 0 and engine.stats.num_requests == 2


def test_no_kv_cache_is_allocated_and_only_the_budget_and_max_num_seqs_bound_a_step():
    runner = FakePoolingRunner()
    engine = make_engine(runner, max_num_seqs=3, budget=9)
    assert engine.num_kv_blocks == 0 and engine.scheduler.block_manager.usage == 0.0
    for i in range(5):
        engine.add_request(f"r{i}", {"prompt_token_ids": [1, 2, 3, 4]}, PoolingParams(), pooling_task="embed")
    run_all(engine)
    assert runner.steps == [("r0", "r1"), ("r2", "r3"), ("r4",)]   # 8 of 9 tokens; a third would not fit whole


def test_prompt_length_rules_per_kind():
    engine = make_engine(max_model_len=8)
    engine.add_request("full", {"prompt_token_ids": list(range(8))}, PoolingParams(), pooling_task="embed")  # == limit
    with pytest.raises(InputError, match="the prompt is 9 tokens; max_model_len is 8"):
        engine.add_request("long", {"prompt_token_ids": list(range(9))}, PoolingParams(), pooling_task="embed")
    cut = PoolingParams(truncate_prompt_tokens=-1)
    engine.add_request("cut", {"prompt_token_ids": list(range(12))}, cut, pooling_task="embed")
    done = run_all(engine)
    assert done["cut"].prompt_token_ids == list(range(4, 12))      # token ids keep the last 8 (vLLM)
    engine.add_request("text", "a bb ccc dddd e f g h i j", PoolingParams(truncate_prompt_tokens=4), pooling_task="embed")
    assert run_all(engine)["text"].prompt_token_ids == [100, 1, 2, 3]   # text: the tokenizer cuts the end


def test_a_refused_request_leaves_no_trace_and_a_duplicate_id_never_corrupts_the_first():
    engine = make_engine()
    engine.add_request("a", {"prompt_token_ids": [1, 2]}, PoolingParams(), pooling_task="embed")
    with pytest.raises(InputError, match="request id 'a' is already running"):
        engine.add_request("a", {"prompt_token_ids": [7, 7, 7]}, PoolingParams(), pooling_task="embed")
    with pytest.raises(InputError, match="empty"):
        engine.add_request("e", {"prompt_token_ids": []}, PoolingParams(), pooling_task="embed")
    with pytest.raises(PoolingParamsError, match="does not support 'classify'"):
        engine.add_request("c", "x", PoolingParams(), pooling_task="classify")
    with pytest.raises(UnsupportedTaskError, match="needs a task"):
        engine.add_request("t", "x", PoolingParams())
    with pytest.raises(UnsupportedTaskError, match="does not generate"):
        engine.add_request("g", "x", SamplingParams())
    assert engine.get_num_unfinished_requests() == 1 and engine.scheduler.get_num_unfinished_requests() == 1
    done = run_all(engine)
    assert list(done) == ["a"] and done["a"].outputs.data.tolist() == [3.0, 2.0]


def test_pooling_params_rules():
    info = PoolingModelInfo("m", ("embed", "classify"), hidden_size=8, matryoshka_dimensions=(4, 8), is_matryoshka=True)
    assert PoolingParams().verify("embed", info) == PoolingParams(task="embed", normalize=True)
    assert PoolingParams().verify("classify", info).use_activation is True
    assert PoolingParams(dimensions=4).verify("embed", info).dimensions == 4
    for bad, match in ((dict(dimensions=0), "dimensions: must be an integer >= 1"),
                       (dict(normalize="yes"), "normalize: must be true or false"),
                       (dict(task="generate"), "task: must be one of"),
                       (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens: must be -1 or")):
        with pytest.raises(PoolingParamsError, match=match):
            PoolingParams(**bad)
    with pytest.raises(PoolingParamsError, match="must be one of \\[4, 8\\]"):
        PoolingParams(dimensions=6).verify("embed", info)
    with pytest.raises(PoolingParamsError, match="dimensions: is not a parameter of task 'classify'"):
        PoolingParams(dimensions=4).verify("classify", info)
    with pytest.raises(PoolingParamsError, match="the params say 'embed' but the request is for 'classify'"):
        PoolingParams(task="embed").verify("classify", info)
    with pytest.raises(PoolingParamsError, match="not a PoolingParams field"):
        PoolingParams.from_dict({"dims": 3})
    assert PoolingParams.from_dict(PoolingParams(dimensions=4, normalize=False).to_dict()).dimensions == 4


# ---------------------------------------------------------------------------- the streaming results API
def reqs(n, **kw):
    return [EngineRequest(f"r{i}", {"prompt_token_ids": [i + 1]}, PoolingParams(), pooling_task="embed",
                          context=("ctx", i), **kw) for i in range(n)]


def test_stream_bounds_what_is_in_flight_and_returns_contexts():
    runner = FakePoolingRunner()
    engine = make_engine(runner, max_num_seqs=8)
    results = list(engine.stream(reqs(7), max_in_flight=2))
    assert sorted(r.request.context[1] for r in results) == list(range(7))
    assert all(r.ok and r.output.outputs.data[0] == r.request.context[1] + 1 for r in results)
    assert max(len(s) for s in runner.steps) <= 2


def test_stream_passes_refusals_and_passthrough_items_back_without_running_them():
    engine = make_engine()
    items = [reqs(1)[0],
             EngineRequest("bad", {"prompt_token_ids": []}, PoolingParams(), pooling_task="embed"),
             EngineRequest("skip", None, None, context="a bad record", passthrough=True)]
    results = {r.request.request_id: r for r in engine.stream(items)}
    assert results["r0"].ok
    assert isinstance(results["bad"].error, InputError) and results["bad"].output is None
    assert results["skip"].output is None and results["skip"].error is None and results["skip"].request.context
    assert not engine.has_unfinished_requests()


def test_a_failing_step_aborts_everything_in_flight_and_the_engine_is_reusable():
    runner = FakePoolingRunner(fail_at_step=2)
    engine = make_engine(runner, max_num_seqs=2)
    seen = []
    with pytest.raises(RuntimeError, match="the model crashed"):
        for r in engine.stream(reqs(6), max_in_flight=4):
            seen.append(r.request.request_id)
    assert seen == ["r0", "r1"]
    assert not engine.has_unfinished_requests() and engine.scheduler.get_num_unfinished_requests() == 0
    runner.fail_at_step = None
    assert len(list(engine.stream(reqs(3)))) == 3            # the same ids run again cleanly


def test_stopping_the_stream_aborts_what_is_in_flight():
    engine = make_engine(max_num_seqs=1)
    stream = engine.stream(reqs(5), max_in_flight=3)
    first = next(stream)
    assert first.ok and engine.get_num_unfinished_requests() == 2
    stream.close()                                           # the consumer stops iterating
    assert not engine.has_unfinished_requests()
    polls = iter([False, True])
    results = list(engine.stream(reqs(5), max_in_flight=3, should_stop=lambda: next(polls, True)))
    assert len(results) == 1 and not engine.has_unfinished_requests()


def test_admit_bounds_pulls_but_never_deadlocks_with_nothing_in_flight():
    engine = make_engine(max_num_seqs=8)
    pulled = []

    def source():
        for r in reqs(4):
            pulled.append(r.request_id)
            yield r
    results = list(engine.stream(source(), max_in_flight=8, admit=lambda: False))
    assert len(results) == 4 and pulled == ["r0", "r1", "r2", "r3"]


class FakeTensorRunner(FakePoolingRunner):
    """A model that takes tensors: its cost is the tensor's element count; outputs echo the sum."""

    takes_tensors = True

    def model_info(self, name):
        return PoolingModelInfo(name=name, supported_tasks=("plugin",), hidden_size=2)

    def check_tensor_inputs(self, data):
        x = torch.as_tensor(data["x"], dtype=torch.float32)
        return {"x": x}, int(x.numel())

    def execute_model(self, sched):
        self.steps.append(tuple(s.request.request_id for s in sched.scheduled))
        for s in sched.scheduled:
            assert s.num_new_tokens == s.request.input_cost and s.request.prompt_token_ids == []
        outs = tuple(s.request.model_inputs["x"].sum().reshape(1) for s in sched.scheduled)
        return ModelRunnerOutput(req_ids=tuple(s.request.request_id for s in sched.scheduled),
                                 sampled_token_ids=tuple(() for _ in sched.scheduled), pooler_outputs=outs)


def test_tensor_requests_are_budgeted_by_the_cost_the_model_declares():
    runner = FakeTensorRunner()
    engine = make_engine(runner, max_model_len=8, budget=10)
    sizes = {"a": 6, "b": 6, "c": 3, "d": 1}
    for rid, n in sizes.items():
        engine.add_request(rid, {"multi_modal_data": {"x": [1.0] * n}}, PoolingParams(), pooling_task="plugin")
    done = run_all(engine)
    assert runner.steps == [("a",), ("b", "c", "d")]        # 6 + 6 > 10: b waits for the next step
    assert {k: float(v.outputs.data) for k, v in done.items()} == {k: float(n) for k, n in sizes.items()}
    assert done["a"].num_prompt_tokens == 6 and done["a"].prompt_token_ids == []
    with pytest.raises(InputError, match="max_model_len"):
        engine.add_request("e", {"multi_modal_data": {"x": [1.0] * 9}}, PoolingParams(), pooling_task="plugin")
    with pytest.raises(InputError, match="takes tensors"):
        engine.add_request("f", "a text prompt", PoolingParams(), pooling_task="plugin")
    assert not engine.has_unfinished_requests()

"""The LLM API end to end on the real default model: chat, sampling features, outputs.

Oracles: transformers (logits, logprobs), the tokenizer (text), and the engine itself run
alone vs in a batch (seeded determinism).
"""
from __future__ import annotations

import math

import pytest
import torch

from vbatch import LLM, SamplingParams
from vbatch.engine.errors import InputError, SamplingParamsError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), dtype="float32", device="cpu", quiet=True, max_model_len=1024)


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()


def test_chat_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))[0]
    assert out.outputs[0].text.strip() == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None   # EOS
    assert out.prompt.startswith("<|im_start|>")
    assert out.metrics.num_generation_tokens == len(out.outputs[0].token_ids)


def test_logits_match_transformers(llm, hf_model):
    """Prefill logits of our model vs transformers' for a real prompt (fp32)."""
    tok = llm.get_tokenizer()
    ids = tok.encode("The three laws of thermodynamics are")
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0, -1].float()
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1, logprobs=20))[0]
    ours = out.outputs[0].logprobs[0]
    ref_lp = torch.log_softmax(ref, -1)
    diffs = [abs(lp.logprob - ref_lp[t].item()) for t, lp in ours.items()]
    assert max(diffs) < 1e-3, f"max logprob diff {max(diffs)}"
    top = torch.topk(ref_lp, 20).indices.tolist()
    assert set(top) <= set(ours)


def test_logprobs_and_cumulative(llm):
    out = llm.generate(["Paris is"], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 5
    total = 0.0
    for tok_id, pos in zip(out.token_ids, out.logprobs):
        assert tok_id in pos and pos[tok_id].rank == 1          # greedy picks the top token
        assert len(pos) == 3 or len(pos) == 4
        total += pos[tok_id].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-6, abs_tol=1e-6)


def test_prompt_logprobs_match_transformers(llm, hf_model):
    tok = llm.get_tokenizer()
    ids = tok.encode("Once upon a time there was a")
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    for i in range(1, len(ids)):
        got = out.prompt_logprobs[i][ids[i]].logprob
        assert abs(got - ref[i - 1, ids[i]].item()) < 1e-3


def test_seeded_sampling_independent_of_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = llm.generate(["Tell me a story about a dragon"], params)[0].outputs[0].token_ids
    others = ["The weather today", "def add(a, b):", "List of fruits:", "Hello"]
    batch = llm.generate(others[:2] + ["Tell me a story about a dragon"] + others[2:],
                         [SamplingParams(temperature=0.7, max_tokens=12)] * 2 + [params]
                         + [SamplingParams(temperature=1.0, max_tokens=20, seed=5)] * 2)
    assert batch[2].outputs[0].token_ids == alone
    other_seed = llm.generate(["Tell me a story about a dragon"], params.replace(seed=99))[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_greater_than_one(llm):
    out = llm.generate(["My favourite colour is"], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_stop_string_cut_and_reported(llm):
    base = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert " 6" in base.text
    out = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=16, stop=[" 6"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == " 6"
    assert out.text == base.text[:base.text.index(" 6")]
    kept = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=16, stop=[" 6"],
                                                         include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == base.text[:base.text.index(" 6") + 2]


def test_stop_token_ids_and_length(llm):
    base = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 8
    stop_id = base.token_ids[3]
    out = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id]))[0]
    o = out.outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop_id
    assert o.token_ids == base.token_ids[:base.token_ids.index(stop_id) + 1]


def test_outputs_in_input_order_and_default_params(llm):
    prompts = [f"Count to {i}:" for i in range(7)]
    outs = llm.generate(prompts)
    assert [o.prompt for o in outs] == prompts
    assert llm.get_default_sampling_params().max_tokens is not None


def test_bad_prompt_errors(llm):
    with pytest.raises(InputError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [1] * 1024}])
    with pytest.raises(InputError, match="empty"):
        llm.generate([{"prompt_token_ids": []}])
    with pytest.raises(SamplingParamsError, match="stop_token_ids"):
        llm.generate(["hi"], SamplingParams(stop_token_ids=[10**7]))
    assert not llm.engine.has_unfinished_requests()


def test_generation_config_folder_sets_defaults(smollm2_path, tmp_path):
    """generation_config=<folder>: its values become the defaults when no SamplingParams is given."""
    import json
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 7, "max_new_tokens": 5}))
    llm = LLM(str(smollm2_path), dtype="float32", device="cpu", quiet=True, max_model_len=256,
              generation_config=str(tmp_path))
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.max_tokens) == (0.3, 7, 5)
    out = llm.generate(["Hello there"])[0].outputs[0]
    assert len(out.token_ids) <= 5
    explicit = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))[0]
    assert len(explicit.outputs[0].token_ids) == 9      # explicit params ignore the file's defaults
    vllm_mode = LLM(str(smollm2_path), dtype="float32", device="cpu", quiet=True, max_model_len=256,
                    generation_config="vllm")
    assert vllm_mode.get_default_sampling_params() == SamplingParams()


def test_pooling_on_a_generation_model_is_a_clear_error(llm):
    from vbatch.engine.errors import UnsupportedTaskError
    with pytest.raises(UnsupportedTaskError, match="is a generation model; pooling"):
        llm.embed("hello")
    assert not llm.engine.has_unfinished_requests()


def test_a_bad_prompt_anywhere_in_the_list_runs_nothing(llm):
    from vbatch.engine.errors import InputError
    before = llm.engine.stats.num_steps
    with pytest.raises(InputError):
        llm.generate(["fine", {"prompt_token_ids": []}, "also fine"], SamplingParams(max_tokens=2))
    assert llm.engine.stats.num_steps == before and not llm.engine.has_unfinished_requests()

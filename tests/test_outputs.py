"""RequestOutput.to_dict: every field, plain JSON types, logprob dicts as lists (oracle: dataclasses.asdict)."""
from __future__ import annotations

import dataclasses
import json

from vbatch.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def _sample() -> RequestOutput:
    lp = {5: Logprob(-0.1, 1, "a"), 7: Logprob(-2.5, 2, "b")}
    return RequestOutput(
        request_id="r1", prompt="hi", prompt_token_ids=[1, 2], prompt_logprobs=[None, lp],
        outputs=[CompletionOutput(0, "ab", [5, 9], -0.3, [lp, lp], "stop", 9)], finished=True,
        metrics=RequestMetrics(arrival_time=1.0, first_token_time=1.5, num_generation_tokens=2),
        num_cached_tokens=16, extra={"k": 1})


def test_to_dict_matches_asdict_except_logprob_shape():
    out = _sample()
    d = out.to_dict()
    ref = dataclasses.asdict(out)
    for key in ("prompt_logprobs",):
        ref.pop(key), d.pop(key)
    for o in ref["outputs"]:
        o.pop("logprobs")
    for o in d["outputs"]:
        assert o.pop("logprobs") == [[{"token_id": 5, "logprob": -0.1, "rank": 1, "token": "a"},
                                      {"token_id": 7, "logprob": -2.5, "rank": 2, "token": "b"}]] * 2
    assert d == ref


def test_to_dict_is_json_ready():
    d = _sample().to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["prompt_logprobs"][0] is None and d["prompt_logprobs"][1][0]["token_id"] == 5

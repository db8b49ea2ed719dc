"""Batch writers: JSONL/Parquet round trips, OpenAI Batch shapes, and the .partial -> rename rule."""
from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest

from vbatch.batch.record import BatchRecord, OpenAIMeta, RecordError
from vbatch.batch.result import BatchResult
from vbatch.batch.writers import JsonlWriter, OpenAIBatchWriter, ParquetWriter, open_writer
from vbatch.engine.errors import ConfigError
from vbatch.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def make_output(request_id="0", text=" Paris.", token_ids=(7042, 30), stop_reason=None, logprobs=None, n=1):
    outs = [CompletionOutput(index=i, text=text, token_ids=list(token_ids), cumulative_logprob=-1.5,
                             logprobs=logprobs, finish_reason="stop", stop_reason=stop_reason) for i in range(n)]
    return RequestOutput(request_id=request_id, prompt="The capital is", prompt_token_ids=[504, 3575, 314],
                         prompt_logprobs=None, outputs=outs, finished=True,
                         metrics=RequestMetrics(arrival_time=1.0, first_token_time=1.5, num_generation_tokens=2),
                         num_cached_tokens=16)


def ok_result(seq, rid="a", **kw):
    rec = BatchRecord(id=rid, line=seq + 1, kind="prompt", prompt="The capital is")
    return BatchResult(seq, record=rec, output=make_output(str(seq), **kw))


def bad_result(seq):
    err = RecordError(id=None, line=seq + 1, field="json", message="invalid JSON: oops", file="in.jsonl")
    return BatchResult(seq, input_error=err)


EXPECTED_OK = {
    "id": "a", "request_id": "0", "prompt": "The capital is", "prompt_token_ids": [504, 3575, 314],
    "prompt_logprobs": None,
    "outputs": [{"index": 0, "text": " Paris.", "token_ids": [7042, 30], "cumulative_logprob": -1.5,
                 "logprobs": None, "finish_reason": "stop", "stop_reason": None}],
    "finished": True,
    "metrics": {"arrival_time": 1.0, "first_scheduled_time": None, "first_token_time": 1.5, "last_token_time": None,
                "finished_time": None, "num_generation_tokens": 2, "num_preemptions": 0},
    "num_cached_tokens": 16, "error": None,
}
EXPECTED_ERR = {"id": None, "request_id": None, "prompt": None, "prompt_token_ids": None, "prompt_logprobs": None,
                "outputs": [], "finished": False, "metrics": None, "num_cached_tokens": 0,
                "error": "in.jsonl:2: json: invalid JSON: oops"}


def test_jsonl_records_and_atomic_rename(tmp_path):
    out = tmp_path / "out.jsonl"
    w = JsonlWriter(str(out), sync_every=1)
    w.write(ok_result(0))
    w.write(bad_result(1))
    # Not closed yet: nothing at the final path, whole lines in the partial file.
    assert not out.exists()
    partial = [json.loads(l) for l in (tmp_path / "out.jsonl.partial").read_text().splitlines()]
    assert partial == [EXPECTED_OK, EXPECTED_ERR]
    w.close()
    assert not (tmp_path / "out.jsonl.partial").exists()
    assert [json.loads(l) for l in out.read_text().splitlines()] == [EXPECTED_OK, EXPECTED_ERR]


def test_writer_left_by_an_exception_keeps_only_the_partial(tmp_path):
    out = tmp_path / "out.jsonl"
    with pytest.raises(KeyboardInterrupt):
        with JsonlWriter(str(out)) as w:
            w.write(ok_result(0))
            raise KeyboardInterrupt
    assert not out.exists()
    assert json.loads((tmp_path / "out.jsonl.partial").read_text()) == EXPECTED_OK


def test_append_reopens_the_partial(tmp_path):
    out = tmp_path / "out.jsonl"
    w = JsonlWriter(str(out))
    w.write(ok_result(0))
    w.abort()
    w2 = JsonlWriter(str(out), append=True)
    w2.write(bad_result(1))
    w2.close()
    assert [json.loads(l) for l in out.read_text().splitlines()] == [EXPECTED_OK, EXPECTED_ERR]


def test_parquet_round_trip(tmp_path):
    out = tmp_path / "out.parquet"
    w = ParquetWriter(str(out), row_group_size=2)
    w.write(ok_result(0))
    w.write(bad_result(1))
    w.write(ok_result(2, rid="c", stop_reason=2, logprobs=[{7042: Logprob(-0.5, 1, " Paris")},
                                                            {30: Logprob(-1.0, 1, "."), 11: Logprob(-2.0, 2, ",")}]))
    assert not out.exists()  # a Parquet file only appears once closed
    w.close()
    assert not (tmp_path / "out.parquet.partial").exists()
    rows = pq.read_table(out).to_pylist()
    third = json.loads(json.dumps(EXPECTED_OK))
    third.update(id="c", request_id="2")
    third["outputs"][0]["stop_reason"] = "2"  # Parquet: stop token ids as strings (one column type)
    third["outputs"][0]["logprobs"] = [
        [{"token_id": 7042, "logprob": -0.5, "rank": 1, "token": " Paris"}],
        [{"token_id": 30, "logprob": -1.0, "rank": 1, "token": "."},
         {"token_id": 11, "logprob": -2.0, "rank": 2, "token": ","}]]
    assert rows == [{**EXPECTED_OK, "extra": None}, {**EXPECTED_ERR, "extra": None}, {**third, "extra": None}]
    assert pq.ParquetFile(out).metadata.num_row_groups == 2


def test_unclosed_parquet_writer_leaves_no_final_file(tmp_path):
    out = tmp_path / "out.parquet"
    w = ParquetWriter(str(out), row_group_size=1)
    w.write(ok_result(0))
    w.write(bad_result(1))
    w.abort()
    assert not out.exists()
    # Parquet resumes through a JSONL partial: the plain records written so far, one a line.
    rows = [json.loads(l) for l in (tmp_path / "out.parquet.partial").read_text().splitlines()]
    assert rows == [EXPECTED_OK, EXPECTED_ERR]
    # Resumed (append) and closed, it converts to the Parquet file the uninterrupted writer makes.
    w2 = ParquetWriter(str(out), append=True, row_group_size=1)
    w2.write(ok_result(2, rid="c"))
    w2.close()
    assert not (tmp_path / "out.parquet.partial").exists()
    third = {**EXPECTED_OK, "id": "c", "request_id": "2"}
    assert pq.read_table(out).to_pylist() == [{**r, "extra": None} for r in (EXPECTED_OK, EXPECTED_ERR, third)]


def test_open_writer_picks_by_extension(tmp_path):
    assert isinstance(open_writer(str(tmp_path / "a.jsonl"), input_format="jsonl", model="m"), JsonlWriter)
    assert isinstance(open_writer(str(tmp_path / "a.parquet"), input_format="parquet", model="m"), ParquetWriter)
    assert isinstance(open_writer(str(tmp_path / "b.jsonl"), input_format="openai", model="m"), OpenAIBatchWriter)
    with pytest.raises(ConfigError, match="--output: OpenAI Batch input writes OpenAI Batch JSONL"):
        open_writer(str(tmp_path / "c.parquet"), input_format="openai", model="m")
    assert not os.path.exists(tmp_path / "c.parquet.partial")


# ---------------------------------------------------------------- OpenAI Batch output
def oa_result(seq, url, top, logprobs=None, n=1):
    rec = BatchRecord(id=f"c{seq}", line=seq + 1, kind="messages" if url.endswith("chat/completions") else "prompt",
                      openai=OpenAIMeta(custom_id=f"c{seq}", url=url, model=None, top_logprobs=top))
    return BatchResult(seq, record=rec, output=make_output(str(seq), logprobs=logprobs, n=n))


LOGPROBS = [{7042: Logprob(-0.25, 1, " Paris"), 11: Logprob(-2.0, 2, " Lyon")},
            {30: Logprob(-0.5, 2, "."), 0: Logprob(-0.1, 1, None)}]


def test_openai_chat_line_shape(tmp_path):
    out = tmp_path / "o.jsonl"
    with OpenAIBatchWriter(str(out), model="smol") as w:
        w.write(oa_result(0, "/v1/chat/completions", top=1, logprobs=LOGPROBS))
        w.write(oa_result(1, "/v1/chat/completions", top=None, n=2))
    first, second = [json.loads(l) for l in out.read_text().splitlines()]
    assert first["custom_id"] == "c0" and first["error"] is None and first["id"].startswith("vbatch-")
    assert first["response"]["status_code"] == 200 and first["response"]["request_id"]
    body = first["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "smol" and body["id"].startswith("chatcmpl-")
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": " Paris."}
    assert choice["finish_reason"] == "stop"
    assert choice["logprobs"] == {"content": [
        {"token": " Paris", "logprob": -0.25, "bytes": list(b" Paris"),
         "top_logprobs": [{"token": " Paris", "logprob": -0.25, "bytes": list(b" Paris")}]},
        # The sampled token (30) was not the most likely; top_logprobs lists the best one, whose
        # text was not decoded, under vLLM's "token_id:N" name.
        {"token": ".", "logprob": -0.5, "bytes": [46],
         "top_logprobs": [{"token": "token_id:0", "logprob": -0.1, "bytes": list(b"token_id:0")}]},
    ]}
    body2 = second["response"]["body"]
    assert [c["index"] for c in body2["choices"]] == [0, 1] and body2["choices"][0]["logprobs"] is None
    assert body2["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_openai_completion_line_shape_and_error_line(tmp_path):
    out = tmp_path / "o.jsonl"
    err = RecordError(id="c9", line=2, field="url", message="unsupported url '/x'", file="b.jsonl", custom_id="c9")
    with OpenAIBatchWriter(str(out), model="smol") as w:
        w.write(oa_result(0, "/v1/completions", top=2, logprobs=LOGPROBS))
        w.write(BatchResult(1, input_error=err))
    first, second = [json.loads(l) for l in out.read_text().splitlines()]
    body = first["response"]["body"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == " Paris."
    assert choice["logprobs"] == {"tokens": [" Paris", "."], "token_logprobs": [-0.25, -0.5],
                                  "top_logprobs": [{" Paris": -0.25, " Lyon": -2.0}, {"token_id:0": -0.1, ".": -0.5}],
                                  "text_offset": [0, 6]}
    assert second["custom_id"] == "c9"
    assert second["response"]["status_code"] == 400 and second["response"]["body"] is None
    assert second["error"] == "b.jsonl:2: url: unsupported url '/x'"

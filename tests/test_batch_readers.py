"""Batch readers: JSONL, Parquet and OpenAI Batch records, good and malformed, with exact problem texts."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vbatch.batch.readers import open_reader
from vbatch.batch.record import BatchRecord, OpenAIMeta, RecordError
from vbatch.engine.errors import InputError


def write_lines(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return str(path)


def problems(path, **kw):
    return [str(r) for r in open_reader(path, **kw) if isinstance(r, RecordError)]


def test_jsonl_good_records_default_ids_and_kinds(tmp_path):
    f = write_lines(tmp_path / "in.jsonl", [
        {"prompt": "Hello"},
        "",
        {"id": "chat", "messages": [{"role": "user", "content": "Hi"}], "sampling_params": {"temperature": 0}},
        {"id": 7, "prompt_token_ids": [1, 2, 3], "meta": {"kept": "ignored"}},
    ])
    reader = open_reader(f)
    assert reader.format == "jsonl"
    recs = list(reader)
    assert recs == [
        BatchRecord(id="1", line=1, kind="prompt", prompt="Hello"),
        BatchRecord(id="chat", line=3, kind="messages", messages=[{"role": "user", "content": "Hi"}],
                    sampling_overrides={"temperature": 0}),
        BatchRecord(id="7", line=4, kind="token_ids", prompt_token_ids=[1, 2, 3]),
    ]
    assert reader.count() == 3


def test_a_byte_order_mark_alone_on_the_first_line_is_a_blank_line(tmp_path):
    # Windows tools write a UTF-8 BOM before the first line; alone there, the line is blank: no record,
    # and the count (the progress bar's total) agrees with the records.
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b"\xef\xbb\xbf\n" + b'{"prompt": "a"}\n\xef\xbb\xbf{"prompt": "b"}\n')
    reader = open_reader(str(f))
    recs = list(reader)
    assert [r.line for r in recs] == [2, 3] and isinstance(recs[0], BatchRecord)
    assert isinstance(recs[1], RecordError)          # a BOM past the first line is content: not JSON
    assert reader.count() == len(recs) == 2


@pytest.mark.parametrize("line, expected", [
    ("{broken", "json: invalid JSON: Expecting property name enclosed in double quotes (column 2)"),
    ("[1, 2]", "record: must be a JSON object, got array"),
    ('{"id": "x"}', "prompt: missing: a record needs one of prompt, messages, prompt_token_ids"),
    ('{"prompt": "a", "prompt_token_ids": [1]}',
     "prompt_token_ids: only one of prompt, messages, prompt_token_ids may be given (got prompt, prompt_token_ids)"),
    ('{"prompt": 5}', "prompt: must be a string, got number"),
    ('{"prompt": ""}', "prompt: must not be empty"),
    ('{"prompt_token_ids": [1, "a"]}', "prompt_token_ids[1]: must be a non-negative integer, got 'a'"),
    ('{"messages": "hi"}', "messages: must be an array of chat messages, got string"),
    ('{"messages": [{"role": "robot", "content": "x"}]}',
     "messages[0].role: must be one of system, developer, user, assistant, tool, got 'robot'"),
    ('{"messages": [{"role": "user", "content": 3}]}',
     "messages[0].content: must be a string or a non-empty array of content parts, got number"),
    ('{"id": [1], "prompt": "a"}', "id: must be a non-empty string or an integer, got [1]"),
    ('{"prompt": "a", "sampling_params": {"temperature": 3}}',
     "sampling_params.temperature: must be in [0, 2], got 3"),
    ('{"prompt": "a", "sampling_params": {"top_p": 0}}', "sampling_params.top_p: must be in (0, 1], got 0"),
    ('{"prompt": "a", "sampling_params": [1]}',
     "sampling_params: must be an object of SamplingParams fields, got array"),
])
def test_jsonl_bad_records_exact_messages(tmp_path, line, expected):
    f = write_lines(tmp_path / "in.jsonl", [{"prompt": "fine"}, line, {"prompt": "also fine"}])
    recs = list(open_reader(f))
    # A bad record never stops reading: the records after it still come.
    assert [type(r).__name__ for r in recs] == ["BatchRecord", "RecordError", "BatchRecord"]
    assert str(recs[1]) == f"{f}:2: {expected}"


def test_unknown_sampling_field_names_it(tmp_path):
    f = write_lines(tmp_path / "in.jsonl", [{"prompt": "a", "sampling_params": {"best_of": 2}}])
    (msg,) = problems(f)
    assert msg.startswith(f"{f}:1: sampling_params.best_of: is not a SamplingParams field (known: ")


def test_sampling_checked_against_command_line_defaults(tmp_path):
    # min_tokens 20 is fine with --max-tokens 64, wrong with the default max_tokens 16.
    f = write_lines(tmp_path / "in.jsonl", [{"prompt": "a", "sampling_params": {"min_tokens": 20}}])
    assert problems(f, sampling_defaults={"max_tokens": 64}) == []
    assert problems(f) == [f"{f}:1: sampling_params.min_tokens: must be <= max_tokens=16, got 20"]


def test_duplicate_ids(tmp_path):
    f = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}, {"prompt": "y"}, {"id": "a", "prompt": "z"},
                                            {"id": "2", "prompt": "w"}])
    assert problems(f) == [f"{f}:3: id: duplicate id 'a' (first on line 1)",
                           f"{f}:4: id: duplicate id '2' (first on line 2)"]


def test_invalid_utf8_is_a_record_error(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff"}\n')
    assert problems(str(p)) == [f"{p}:2: json: not valid UTF-8 (invalid start byte at byte 12)"]


def test_missing_file_is_input_error(tmp_path):
    with pytest.raises(InputError, match="no such file") as e:
        open_reader(str(tmp_path / "nope.jsonl"))
    assert e.value.exit_code == 3


def test_stdin_is_read_once_with_the_peeked_line(tmp_path):
    data = b'{"prompt": "a"}\n{"prompt": "b"}\n'
    reader = open_reader("-", stdin=io.BytesIO(data))
    assert reader.format == "jsonl" and reader.name == "<stdin>"
    assert [r.prompt for r in reader] == ["a", "b"]
    assert reader.count() is None


def test_reader_is_lazy():
    # A stream that counts what was pulled from it: the first record must come out after
    # reading one line, not the whole (here endless) input.
    pulled = []

    class Endless:
        def __iter__(self):
            i = 0
            while True:
                pulled.append(i)
                yield json.dumps({"prompt": f"p{i}"}).encode() + b"\n"
                i += 1

    it = iter(open_reader("-", stdin=Endless()))
    assert next(it).prompt == "p0" and next(it).prompt == "p1"
    assert len(pulled) <= 3


# ---------------------------------------------------------------- Parquet
def test_parquet_rows_with_struct_sampling_and_nulls(tmp_path):
    rows = [
        {"id": None, "prompt": "Hello", "messages": None, "sampling_params": {"temperature": 0.5, "max_tokens": None}},
        {"id": "m", "prompt": None, "messages": [{"role": "user", "content": "Hi"}],
         "sampling_params": {"temperature": None, "max_tokens": 8}},
        {"id": "bad", "prompt": None, "messages": None, "sampling_params": None},
    ]
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    reader = open_reader(str(path))
    assert reader.format == "parquet" and reader.count() == 3
    recs = list(reader)
    assert recs[0] == BatchRecord(id="0", line=0, kind="prompt", prompt="Hello",
                                  sampling_overrides={"temperature": 0.5})
    assert recs[1] == BatchRecord(id="m", line=1, kind="messages", messages=[{"role": "user", "content": "Hi"}],
                                  sampling_overrides={"max_tokens": 8})
    assert str(recs[2]) == f"{path}:2: prompt: missing: a record needs one of prompt, messages, prompt_token_ids"


def test_parquet_detected_by_content_and_token_ids(tmp_path):
    path = tmp_path / "data.bin"
    pq.write_table(pa.table({"prompt_token_ids": [[1, 2], [3]]}), path)
    reader = open_reader(str(path))
    assert reader.format == "parquet"
    assert [r.prompt_token_ids for r in reader] == [[1, 2], [3]]


def test_a_jsonl_name_is_read_as_jsonl_whatever_its_first_bytes(tmp_path):
    # Found by tests/test_reader_fuzz.py: a .jsonl whose first line is the text PAR1 was opened as
    # Parquet and the whole run failed (exit 3); it is a bad JSON line, one record's error.
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'PAR1\n{"prompt": "ok"}\n')
    reader = open_reader(str(path))
    assert reader.format == "jsonl"
    first, second = list(reader)
    assert isinstance(first, RecordError) and first.line == 1
    assert second.prompt == "ok"


# ---------------------------------------------------------------- OpenAI Batch
def oa(custom_id, url="/v1/chat/completions", **body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_openai_chat_and_completions_field_mapping(tmp_path):
    msgs = [{"role": "user", "content": "Hi"}]
    f = write_lines(tmp_path / "b.jsonl", [
        oa("c1", model="m", messages=msgs, max_completion_tokens=9, max_tokens=99, temperature=0.2, top_p=0.9,
           n=1, stop="END", seed=4, logprobs=True, top_logprobs=3, presence_penalty=0.1,
           frequency_penalty=-0.1, logit_bias={"5": 1.5}, user="ignored"),
        oa("c2", "/v1/completions", prompt="Once", max_tokens=5, logprobs=2),
        oa("c3", "/v1/completions", prompt=[[4, 5, 6]]),
        oa("c4", messages=msgs, logprobs=True),
    ])
    reader = open_reader(f)
    assert reader.format == "openai"
    c1, c2, c3, c4 = list(reader)
    assert c1 == BatchRecord(
        id="c1", line=1, kind="messages", messages=msgs,
        sampling_overrides={"temperature": 0.2, "top_p": 0.9, "n": 1, "stop": "END", "seed": 4,
                            "presence_penalty": 0.1, "frequency_penalty": -0.1, "logit_bias": {"5": 1.5},
                            "max_tokens": 9, "logprobs": 3},
        openai=OpenAIMeta(custom_id="c1", url="/v1/chat/completions", model="m", top_logprobs=3))
    assert c2.kind == "prompt" and c2.prompt == "Once"
    assert c2.sampling_overrides == {"max_tokens": 5, "logprobs": 2}
    assert c2.openai == OpenAIMeta(custom_id="c2", url="/v1/completions", model=None, top_logprobs=2)
    assert c3.kind == "token_ids" and c3.prompt_token_ids == [4, 5, 6]
    assert c4.sampling_overrides == {"logprobs": 0} and c4.openai.top_logprobs == 0


@pytest.mark.parametrize("line, expected", [
    (oa("e1", "/v1/embeddings", input="x"),
     "url: unsupported url '/v1/embeddings'; vbatch serves /v1/chat/completions, /v1/completions (vbatch embed serves /v1/embeddings)"),
    ({**oa("e2", messages=[{"role": "user", "content": "x"}]), "method": "GET"}, "method: must be POST, got 'GET'"),
    ({"custom_id": "", "method": "POST", "url": "/v1/completions", "body": {}}, "custom_id: must be a non-empty string, got ''"),
    (oa("e4"), "body.messages: must be an array of chat messages, got null"),
    (oa("e5", "/v1/completions", prompt=["a", "b"]),
     "body.prompt: must be one string or one array of token ids; put each prompt on its own line"),
    (oa("e6", messages=[{"role": "user", "content": "x"}], temperature=5),
     "body.temperature: must be in [0, 2], got 5"),
    (oa("e7", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=50),
     "body.top_logprobs: must be an integer in [0, 20] or None, got 50"),
    (oa("e8", messages=[{"role": "user", "content": "x"}], max_completion_tokens=0),
     "body.max_completion_tokens: must be an integer >= 1 or None, got 0"),
    (oa("e9", messages=[{"role": "user", "content": "x"}], tools=[{}]), "body.tools: is not supported by vbatch"),
    (oa("e10", messages=[{"role": "user", "content": "x"}], stream=True), "body.stream: must be false in a batch file"),
])
def test_openai_bad_lines(tmp_path, line, expected):
    f = write_lines(tmp_path / "b.jsonl", [oa("ok", "/v1/completions", prompt="a"), line])
    recs = list(open_reader(f))
    assert isinstance(recs[0], BatchRecord) and isinstance(recs[1], RecordError)
    assert str(recs[1]) == f"{f}:2: {expected}"
    assert recs[1].custom_id == (line.get("custom_id") or None)


def test_openai_duplicate_custom_id(tmp_path):
    f = write_lines(tmp_path / "b.jsonl", [oa("x", "/v1/completions", prompt="a"),
                                           oa("x", "/v1/completions", prompt="b")])
    (err,) = [r for r in open_reader(f) if isinstance(r, RecordError)]
    assert str(err) == f"{f}:2: custom_id: duplicate custom_id 'x' (first on line 1)"
    assert err.custom_id == "x"


def test_sample_files_are_clean():
    root = Path(__file__).resolve().parent.parent
    for name, fmt in (("sample_data/prompts.jsonl", "jsonl"), ("sample_data/openai_batch.jsonl", "openai")):
        reader = open_reader(str(root / name))
        recs = list(reader)
        assert reader.format == fmt
        assert not [str(r) for r in recs if isinstance(r, RecordError)]
        assert len(recs) >= 6

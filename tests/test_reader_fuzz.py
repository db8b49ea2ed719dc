"""Fuzzed readers (hypothesis): whatever bytes a batch file holds, every non-blank line (JSONL, OpenAI
Batch) or row (Parquet) becomes exactly one record, an answer or an error naming its line, and
nothing raises; through `vbatch run` every such line gets exactly one output record; reading
streams (memory stays flat however long the file)."""
from __future__ import annotations

import json
import string
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from vbatch.batch.readers import open_reader
from vbatch.batch.record import BatchRecord, RecordError
from vbatch.cli import run as run_cmd
from vbatch.cli.main import app

from test_batch_runner import FakeLLM  # noqa: E402  (tests/ is on sys.path under pytest)

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30),
                         st.floats(allow_nan=False), st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                  st.dictionaries(st.text(max_size=8), inner,
                                                                                  max_size=4)),
                           max_leaves=12)
sampling = st.dictionaries(st.sampled_from(["temperature", "max_tokens", "top_p", "n", "stop", "seed", "top_k",
                                            "logprobs", "bogus"]), json_values, max_size=3)
good_record = st.fixed_dictionaries({"prompt": st.text(string.ascii_letters + " ", min_size=1, max_size=30)},
                                    optional={"sampling_params": st.just({"max_tokens": 3})})
plain_record = st.one_of(
    good_record,
    st.fixed_dictionaries({}, optional={"id": json_values, "prompt": json_values, "messages": json_values,
                                        "prompt_token_ids": json_values, "sampling_params": sampling}),
    json_values)


def _bytes_line(obj) -> bytes:
    return json.dumps(obj).encode()


weird_line = st.one_of(
    plain_record.map(_bytes_line),
    st.binary(max_size=40).filter(lambda b: b"\n" not in b),                       # random bytes, invalid UTF-8
    plain_record.map(_bytes_line).map(lambda b: b[: max(1, len(b) // 2)]),          # truncated JSON
    st.integers(50, 5000).map(lambda d: b"[" * d + b"]" * d),                      # deep nesting
    st.integers(1, 3).map(lambda k: b'{"prompt": "x", "id": ' + b"9" * (4400 * k) + b"}"),   # huge numbers
    st.just(b'{"prompt": "x", "sampling_params": {"temperature": 1e999}}'),
    st.just(b"   "),                                                               # blank
)


def _expected_lines(lines: list[bytes]) -> list[int]:
    """The non-blank lines as a reader sees them: a UTF-8 byte order mark opening the file is not content."""
    first = lines[0].removeprefix(b"\xef\xbb\xbf") if lines else b""
    return [i for i, raw in enumerate([first, *lines[1:]], start=1) if raw.strip()]


def _records(path):
    return list(open_reader(str(path)))


def _check_one_per_line(recs, lines):
    assert all(isinstance(r, (BatchRecord, RecordError)) for r in recs)
    assert [r.line for r in recs] == _expected_lines(lines)
    for r in recs:
        if isinstance(r, RecordError):
            assert r.message and r.field and str(r.line) in str(r)


@FUZZ
@given(st.lists(weird_line, min_size=1, max_size=12))
@example(lines=[b"\xef\xbb\xbf"])                                 # a byte order mark alone: a blank line
@example(lines=[b"\xef\xbb\xbf" + _bytes_line({"prompt": "x"}), b"\xef\xbb\xbf"])  # only the first line's is one
def test_every_jsonl_line_becomes_exactly_one_record(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("fuzz") / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    _check_one_per_line(_records(path), lines)


openai_line = st.fixed_dictionaries(
    {"custom_id": st.one_of(st.text(max_size=6), json_values), "method": st.sampled_from(["POST", "GET", 3]),
     "url": st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/x", None]),
     "body": st.one_of(json_values, st.fixed_dictionaries({}, optional={
         "messages": json_values, "prompt": json_values, "max_tokens": json_values, "temperature": json_values,
         "logprobs": json_values, "n": json_values, "stop": json_values}))})


@FUZZ
@given(st.lists(st.one_of(openai_line.map(_bytes_line), weird_line), min_size=1, max_size=10))
def test_every_openai_batch_line_becomes_exactly_one_record(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("fuzz") / "batch.jsonl"
    first = _bytes_line({"custom_id": "c0", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "hi", "max_tokens": 2}})
    lines = [first] + lines
    path.write_bytes(b"\n".join(lines) + b"\n")
    reader = open_reader(str(path))
    assert reader.format == "openai"
    _check_one_per_line(list(reader), lines)


column_values = {
    "prompt": st.one_of(st.lists(st.one_of(st.none(), st.text(max_size=10)), min_size=1, max_size=6),
                        st.lists(st.one_of(st.none(), st.integers(-5, 5)), min_size=1, max_size=6)),
    "id": st.lists(st.one_of(st.none(), st.text(max_size=5)), min_size=1, max_size=6),
    "prompt_token_ids": st.lists(st.one_of(st.none(), st.lists(st.integers(-3, 10**6), max_size=4)),
                                 min_size=1, max_size=6),
}


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(column_values)), st.just(None), min_size=1).flatmap(
    lambda keys: st.fixed_dictionaries({k: column_values[k] for k in keys})))
def test_every_parquet_row_becomes_exactly_one_record(tmp_path_factory, columns):
    n = min(len(v) for v in columns.values())
    table = pa.table({k: v[:n] for k, v in columns.items()})
    path = tmp_path_factory.mktemp("fuzz") / "in.parquet"
    pq.write_table(table, path)
    recs = _records(path)
    assert len(recs) == n and all(isinstance(r, (BatchRecord, RecordError)) for r in recs)
    assert [r.line for r in recs] == list(range(n))


@pytest.fixture
def fake_model(monkeypatch):
    monkeypatch.setattr(run_cmd, "load_llm", lambda model, kwargs: FakeLLM())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(weird_line, min_size=1, max_size=10))
def test_vbatch_run_writes_one_output_record_per_input_line(tmp_path_factory, fake_model, lines):
    folder = tmp_path_factory.mktemp("fuzzrun")
    (folder / "in.jsonl").write_bytes(b"\n".join(lines))         # and no newline after the last line
    r = CliRunner().invoke(app, ["run", str(folder / "in.jsonl"), "-o", str(folder / "out.jsonl")])
    assert r.exit_code in (0, 1), (r.exit_code, r.output[-1500:])
    out = [json.loads(x) for x in (folder / "out.jsonl").read_text().splitlines()]
    assert len(out) == len(_expected_lines(lines))
    assert all((o["error"] is None) == bool(o.get("outputs")) for o in out)
    assert r.exit_code == (1 if any(o["error"] for o in out) else 0)


def test_reading_streams_in_bounded_memory(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(60_000):
            f.write(json.dumps({"id": i, "prompt": f"record {i} " + "x" * 200}) + "\n")    # ~13 MB
    tracemalloc.start()
    count = 0
    for rec in open_reader(str(path)):
        count += 1
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert count == 60_000
    # the duplicate-id table holds one small entry per record; no record text is kept
    assert peak < 12 * 2**20, peak

"""`vbatch embed` end to end on the real all-MiniLM-L6-v2: JSONL / Parquet / OpenAI Batch in and out,
per-record errors in place, resume after an interruption, shards and merge, refusals before the
model loads. Embeddings are checked against `LLM.embed` (itself checked against transformers in
test_pooling_models.py)."""
from __future__ import annotations

import base64
import json
import struct

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from vbatch.cli import run as run_cmd
from vbatch.cli.main import app

runner = CliRunner()
TEXTS = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
         "A man is riding a horse.", "Two men pushed carts through the woods.", "x"]


@pytest.fixture(scope="module")
def llm(minilm_path):
    from vbatch import LLM
    return LLM(str(minilm_path), quiet=True)


@pytest.fixture
def loads(monkeypatch, llm):
    calls = []

    def fake_load(model, kwargs):       # the real model, loaded once for the module
        calls.append((model, kwargs))
        return llm
    monkeypatch.setattr(run_cmd, "load_llm", fake_load)
    return calls


def write(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return str(path)


def want(llm, texts):
    return [o.outputs.embedding for o in llm.embed(list(texts))]


def close(a, b):
    return float((torch.tensor(a) - torch.tensor(b)).abs().max()) < 1e-6


def test_jsonl_in_and_out_with_bad_records_in_place(tmp_path, loads, llm):
    f = write(tmp_path / "in.jsonl", [
        {"id": "a", "text": TEXTS[0]}, {"id": "b", "prompt": TEXTS[1]}, {"input": TEXTS[2]},
        '{"id": "broken", ', {"id": "e", "text": ""}, {"id": "m", "messages": [{"role": "user", "content": "hi"}]},
        {"id": "long", "text": "word " * 300}, {"id": "ids", "prompt_token_ids": [101, 2158, 102]}])
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["embed", f, "-o", str(out)])
    assert result.exit_code == 1, result.output             # some records failed
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["a", "b", "3", None, "e", "m", "long", "ids"]
    good = want(llm, TEXTS[:3])
    for r, w in zip(recs[:3], good):
        assert r["error"] is None and close(r["embedding"], w) and len(r["embedding"]) == 384
    assert recs[0]["num_tokens"] == 8
    assert recs[3]["error"].startswith(f"{f}:4: json: invalid JSON")
    assert recs[4]["error"] == f"{f}:5: text: must not be empty"
    assert "chat messages cannot be embedded" in recs[5]["error"]
    assert recs[6]["error"] == "prompt: the prompt is 302 tokens; max_model_len is 256" and recs[6]["embedding"] is None
    assert recs[7]["error"] is None and recs[7]["num_tokens"] == 3
    assert "4 bad records" not in result.output and f"{f}:4: json" in result.output   # listed before the model loads
    assert loads[0][0] == "all-minilm-l6-v2"


def test_truncate_and_no_normalize(tmp_path, loads, llm):
    f = write(tmp_path / "in.jsonl", [{"id": "long", "text": "word " * 300}, {"id": "s", "text": TEXTS[0]}])
    out = tmp_path / "out.jsonl"
    assert runner.invoke(app, ["embed", f, "-o", str(out), "--truncate", "-1", "--no-normalize"]).exit_code == 0
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert recs[0]["num_tokens"] == 256
    from vbatch.engine.pooling_params import PoolingParams
    raw = llm.embed([TEXTS[0]], PoolingParams(normalize=False))[0].outputs.embedding
    assert close(recs[1]["embedding"], raw) and abs(float(torch.tensor(raw).norm()) - 1) > 1e-3


def test_parquet_output_has_a_fixed_size_list_column(tmp_path, loads, llm):
    table = pa.table({"id": ["p0", "p1", "p2"], "text": TEXTS[:3]})
    pq.write_table(table, tmp_path / "in.parquet")
    out = tmp_path / "out.parquet"
    result = runner.invoke(app, ["embed", str(tmp_path / "in.parquet"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    got = pq.read_table(out)
    assert got.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    rows = got.to_pylist()
    assert [r["id"] for r in rows] == ["p0", "p1", "p2"]
    for r, w in zip(rows, want(llm, TEXTS[:3])):
        assert float((torch.tensor(r["embedding"]) - torch.tensor(w)).abs().max()) < 1e-6   # float32 column


def test_openai_embeddings_lines_in_and_out(tmp_path, loads, llm):
    def line(cid, body, url="/v1/embeddings"):
        return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "minilm", **body}}
    f = write(tmp_path / "batch.jsonl", [
        line("one", {"input": TEXTS[0]}),
        line("many", {"input": TEXTS[1:4]}),
        line("b64", {"input": TEXTS[4], "encoding_format": "base64"}),
        line("chat", {"messages": []}, url="/v1/chat/completions"),
        line("dims", {"input": "x", "dimensions": 8})])
    out = tmp_path / "results.jsonl"
    result = runner.invoke(app, ["embed", f, "-o", str(out)])
    assert result.exit_code == 1, result.output
    lines = [json.loads(l) for l in out.read_text().splitlines()]
    assert [l["custom_id"] for l in lines] == ["one", "many", "b64", "chat", "dims"]
    one, many, b64, chat, dims = lines
    body = one["response"]["body"]
    assert one["response"]["status_code"] == 200 and body["object"] == "list" and body["model"] == "minilm"
    assert close(body["data"][0]["embedding"], want(llm, TEXTS[:1])[0])
    data = many["response"]["body"]["data"]
    assert [d["index"] for d in data] == [0, 1, 2]
    for d, w in zip(data, want(llm, TEXTS[1:4])):
        assert close(d["embedding"], w)
    usage = many["response"]["body"]["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] == sum(
        len(o.prompt_token_ids) for o in llm.embed(TEXTS[1:4]))
    raw = base64.b64decode(b64["response"]["body"]["data"][0]["embedding"])
    assert close(list(struct.unpack(f"<{len(raw) // 4}f", raw)), want(llm, TEXTS[4:5])[0])
    assert chat["response"]["status_code"] == 400 and "vbatch embed serves /v1/embeddings" in chat["error"]
    assert dims["response"]["status_code"] == 400 and "matryoshka" in dims["error"]


def test_resume_after_an_interruption_equals_an_uninterrupted_run(tmp_path, monkeypatch, llm):
    texts = [f"sentence number {i} about {'cats' if i % 2 else 'dogs'}" for i in range(12)]
    f = write(tmp_path / "in.jsonl", [{"id": f"r{i}", "text": t} for i, t in enumerate(texts)])

    class Interrupting:
        """The real LLM, whose stream raises KeyboardInterrupt after `after` results (a Ctrl-C mid-run)."""

        def __init__(self, after):
            self.after = after

        def __getattr__(self, name):
            return getattr(llm, name)

        def stream(self, requests, **kw):
            for i, r in enumerate(llm.stream(requests, **kw)):
                if i == self.after:
                    raise KeyboardInterrupt
                yield r
    monkeypatch.setattr(run_cmd, "load_llm", lambda model, kw: Interrupting(5))
    out = tmp_path / "out.jsonl"
    first = runner.invoke(app, ["embed", f, "-o", str(out), "--max-in-flight", "2", "--max-num-seqs", "2"])
    assert first.exit_code != 0 and not out.exists()
    assert 0 < len((tmp_path / "out.jsonl.partial").read_text().splitlines()) <= 5
    monkeypatch.setattr(run_cmd, "load_llm", lambda model, kw: llm)
    second = runner.invoke(app, ["embed", f, "-o", str(out), "--max-in-flight", "2", "--max-num-seqs", "2"])
    assert second.exit_code == 0 and "resuming after" in second.output
    whole = tmp_path / "whole.jsonl"
    assert runner.invoke(app, ["embed", f, "-o", str(whole)]).exit_code == 0
    a = [json.loads(l) for l in out.read_text().splitlines()]
    b = [json.loads(l) for l in whole.read_text().splitlines()]
    assert [r["id"] for r in a] == [f"r{i}" for i in range(12)]
    assert all(x["id"] == y["id"] and close(x["embedding"], y["embedding"]) for x, y in zip(a, b))
    again = runner.invoke(app, ["embed", f, "-o", str(out)])
    assert again.exit_code == 0 and "already complete" in again.output
    # a `vbatch run` output is never resumed by `vbatch embed` (and the reverse)
    other = runner.invoke(app, ["run", f, "-o", str(out)])
    assert other.exit_code != 0 and "belongs to another run" in other.output


def test_shards_and_merge(tmp_path, loads, llm):
    f = write(tmp_path / "in.jsonl", [{"id": f"s{i}", "text": t} for i, t in enumerate(TEXTS)])
    out = tmp_path / "out.parquet"
    for i in range(2):
        assert runner.invoke(app, ["embed", f, "-o", str(out), "--shard", f"{i}/2"]).exit_code == 0
    merged = runner.invoke(app, ["merge", str(out), "--input", f])
    assert merged.exit_code == 0, merged.output
    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == [f"s{i}" for i in range(6)]
    for r, w in zip(rows, want(llm, TEXTS)):
        assert float((torch.tensor(r["embedding"]) - torch.tensor(w)).abs().max()) < 1e-6


def test_refusals_before_the_model_loads(tmp_path, loads):
    f = write(tmp_path / "in.jsonl", [{"id": "a", "text": "x"}])
    bad = runner.invoke(app, ["embed", f, "-o", str(tmp_path / "o.jsonl"), "--dimensions", "0"])
    assert bad.exit_code == 2 and "--dimensions: must be an integer >= 1" in bad.output
    strict = write(tmp_path / "bad.jsonl", [{"id": "a", "text": "x"}, {"id": "b"}])
    failed = runner.invoke(app, ["embed", strict, "-o", str(tmp_path / "o2.jsonl"), "--on-error", "fail"])
    assert failed.exit_code == 3 and "text: missing" in failed.output
    assert loads == []


def test_a_generation_model_is_refused_at_once(tmp_path, monkeypatch):
    class GenerationLLM:
        is_pooling_model = False
    monkeypatch.setattr(run_cmd, "load_llm", lambda model, kw: GenerationLLM())
    f = write(tmp_path / "in.jsonl", [{"id": "a", "text": "x"}])
    result = runner.invoke(app, ["embed", f, "-o", str(tmp_path / "o.jsonl"), "--model", "smollm2-135m-instruct"])
    assert result.exit_code == 2 and "is a generation model" in result.output
    assert not (tmp_path / "o.jsonl.partial").exists()

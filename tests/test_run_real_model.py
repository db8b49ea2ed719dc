"""`vbatch run` / `vbatch merge` on the real default model (slow; one model load for the module).

The CLI runs in-process through CliRunner with the module's LLM injected at the `load_llm` seam.
Oracle: the same LLM's Python API (`generate` / `chat`, greedy, same max_tokens), which the engine
equality tests check against transformers; the CLI must give each record exactly that answer,
whatever the input format, output format, bad neighbours or sharding.
"""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from vbatch.cli import run as run_cmd
from vbatch.cli.main import app

torch.set_num_threads(1)
pytestmark = pytest.mark.slow
runner = CliRunner()
MAX_TOKENS = 6
FLAGS = ["--temperature", "0", "--max-tokens", str(MAX_TOKENS), "--dtype", "float32", "--max-model-len", "512"]
RECORDS = [
    {"id": "p1", "prompt": "The capital of France is"},
    {"id": "c1", "messages": [{"role": "user", "content": "Name a colour."}]},
    {"id": "t1", "prompt_token_ids": [504, 3575, 282, 4649, 314]},
    {"id": "p2", "prompt": "1, 2, 3, 4,"},
    {"id": "c2", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]},
    {"id": "p3", "prompt": "Once upon a time"},
]


@pytest.fixture(scope="module")
def llm():
    from vbatch import LLM
    return LLM("smollm2-135m-instruct", dtype="float32", max_model_len=512, kv_cache_memory="256MiB",
               max_num_seqs=4, quiet=True)


@pytest.fixture(autouse=True)
def inject(llm, monkeypatch):
    for name in ("VBATCH_SHARD", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(run_cmd, "load_llm", lambda model, kwargs: llm)


@pytest.fixture(scope="module")
def oracle(llm):
    """id -> (text, token_ids) from the Python API."""
    params = llm.get_default_sampling_params().replace(temperature=0.0, max_tokens=MAX_TOKENS)
    answers = {}
    for rec in RECORDS:
        if "messages" in rec:
            out = llm.chat(rec["messages"], params)[0]
        elif "prompt" in rec:
            out = llm.generate(rec["prompt"], params)[0]
        else:
            out = llm.generate({"prompt_token_ids": rec["prompt_token_ids"]}, params)[0]
        answers[rec["id"]] = (out.outputs[0].text, list(out.outputs[0].token_ids))
    return answers


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_out(path):
    with open(path, "rb") as f:
        if f.read(4) == b"PAR1":
            return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in open(path)]


def answers_of(rows):
    return {r["id"]: (r["outputs"][0]["text"], r["outputs"][0]["token_ids"]) for r in rows if r["error"] is None}


def run(*args, env=None):
    return runner.invoke(app, ["run", *map(str, args), *FLAGS], env=env)


@pytest.mark.parametrize("in_fmt, out_suffix", [("jsonl", ".jsonl"), ("jsonl", ".parquet"),
                                                ("parquet", ".jsonl"), ("parquet", ".parquet")])
def test_plain_round_trips_answer_like_the_python_api(tmp_path, oracle, in_fmt, out_suffix):
    if in_fmt == "jsonl":
        inp = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    else:
        inp = tmp_path / "in.parquet"
        keys = ("id", "prompt", "messages", "prompt_token_ids")  # every row every column (null = absent)
        pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in RECORDS]), inp)
    out = tmp_path / f"out{out_suffix}"
    result = run(inp, "-o", out)
    assert result.exit_code == 0, result.output
    rows = read_out(out)
    assert [r["id"] for r in rows] == [r["id"] for r in RECORDS]
    assert answers_of(rows) == oracle


def test_openai_batch_round_trip(tmp_path, oracle):
    lines = []
    for rec in RECORDS:
        if "messages" in rec:
            lines.append({"custom_id": rec["id"], "method": "POST", "url": "/v1/chat/completions",
                          "body": {"model": "m", "messages": rec["messages"]}})
        else:
            prompt = rec.get("prompt", rec.get("prompt_token_ids"))
            lines.append({"custom_id": rec["id"], "method": "POST", "url": "/v1/completions",
                          "body": {"model": "m", "prompt": prompt}})
    inp = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out.jsonl"
    result = run(inp, "-o", out)
    assert result.exit_code == 0, result.output
    rows = read_out(out)
    assert [r["custom_id"] for r in rows] == [r["id"] for r in RECORDS]
    for r in rows:
        body = r["response"]["body"]
        choice = body["choices"][0]
        text = choice["message"]["content"] if body["object"] == "chat.completion" else choice["text"]
        assert r["error"] is None and r["response"]["status_code"] == 200
        assert text == oracle[r["custom_id"]][0]
        assert body["usage"]["completion_tokens"] == len(oracle[r["custom_id"]][1])


def test_malformed_input_answers_every_good_record_and_reports_every_bad_one(tmp_path, oracle):
    lines = [RECORDS[0],
             '{"id": "b1", "prompt": "unclosed"',
             {"id": "b2", "sampling_params": {"max_tokens": 2}},
             {"id": "b3", "prompt": 5},
             {"id": "b4", "prompt": "hi", "sampling_params": {"temperature": 9}},
             RECORDS[1], RECORDS[2]]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    result = run(inp, "-o", out)
    assert result.exit_code == 1, result.output
    rows = read_out(out)
    assert [r["id"] for r in rows] == ["p1", None, "b2", "b3", "b4", "c1", "t1"]  # one per line, nothing else
    assert answers_of(rows) == {k: oracle[k] for k in ("p1", "c1", "t1")}
    problems = {
        2: "json: invalid JSON: Expecting ',' delimiter (column 1)",
        3: "prompt: missing: a record needs one of prompt, messages, prompt_token_ids",
        4: "prompt: must be a string, got number",
        5: "sampling_params.temperature: must be in [0, 2], got 9",
    }
    for line, problem in problems.items():
        message = f"{inp}:{line}: {problem}"
        assert rows[line - 1]["error"] == message and rows[line - 1]["outputs"] == []
        assert message in result.stderr  # the first pass, before the model ran
    for rid in ("b2", "b3", "b4"):
        assert f"id '{rid}': {inp}:" in result.stderr  # the summary's error list
    assert "errors (first 4 of 4)" in result.stderr


def test_three_shards_then_merge_equal_the_unsharded_run(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", RECORDS + [{"id": "p4", "prompt": "Water boils at"}])
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert run(inp, "-o", ref).exit_code == 0
    assert run(inp, "-o", out, "--shard", "0/3").exit_code == 0
    assert run(inp, "-o", out, env={"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "3"}).exit_code == 0
    assert run(inp, "-o", out, env={"VBATCH_SHARD": "2/3"}).exit_code == 0
    merged = runner.invoke(app, ["merge", str(out), "--input", str(inp)])
    assert merged.exit_code == 0, merged.output

    def stable(rows):
        return [{k: v for k, v in r.items() if k not in ("metrics", "request_id")} for r in rows]

    assert stable(read_out(out)) == stable(read_out(ref))
    assert len(read_out(out)) == 7


def test_a_thousand_lines_one_token_each(tmp_path, llm):
    n = 1000
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": f"Say {i}"} for i in range(n)])
    out, metrics = tmp_path / "out.jsonl", tmp_path / "m.json"
    result = runner.invoke(app, ["run", str(inp), "-o", str(out), "--max-tokens", "1", "--temperature", "0",
                                 "--metrics-json", str(metrics)])
    assert result.exit_code == 0, result.output
    rows = read_out(out)
    assert [r["id"] for r in rows] == [f"q{i}" for i in range(n)]
    assert all(len(r["outputs"][0]["token_ids"]) == 1 for r in rows)
    m = json.loads(metrics.read_text())
    assert m["num_requests"] == n and m["generated_tokens"] == n and m["num_errors"] == 0
    assert m["prompt_tokens"] == sum(len(r["prompt_token_ids"]) for r in rows)

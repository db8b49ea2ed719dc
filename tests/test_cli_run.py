"""`vbatch run` wiring with the engine replaced by the runner tests' FakeLLM (a test double of
vbatch.LLM's interface): outputs, exit codes, --strict, --metrics-json, checks before model load.
The real-model run is tested separately (slow)."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from test_batch_runner import FakeLLM  # noqa: E402  (tests/ is on sys.path under pytest)
from vbatch.cli import run as run_cmd
from vbatch.cli.main import app

runner = CliRunner()


@pytest.fixture
def loads(monkeypatch):
    calls = []

    def fake_load(model, kwargs):
        calls.append((model, kwargs))
        return FakeLLM()

    monkeypatch.setattr(run_cmd, "load_llm", fake_load)
    return calls


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_run_passes_the_storage_dtypes_and_records_them_in_the_manifest(tmp_path, loads):
    f = write(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["run", f, "-o", str(out), "--dtype", "float32", "--weight-dtype", "float16",
                                 "--kv-cache-dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    assert loads[0][1] == {"dtype": "float32", "weight_dtype": "float16", "kv_cache_dtype": "bfloat16"}
    manifest = json.loads((tmp_path / "out.jsonl.manifest.json").read_text())
    # a resume must use the same storage
    assert manifest["options"]["weight_dtype"] == "float16" and manifest["options"]["kv_cache_dtype"] == "bfloat16"
    assert "quantization" not in manifest["options"]   # unset: manifests written before the option still match


def test_run_passes_quantization_and_a_resume_must_match_it(tmp_path, loads):
    f = write(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["run", f, "-o", str(out), "--quantization", "q8_0"])
    assert result.exit_code == 0, result.output
    assert loads[0][1] == {"dtype": "auto", "quantization": "q8_0"}
    manifest = json.loads((tmp_path / "out.jsonl.manifest.json").read_text())
    assert manifest["options"]["quantization"] == "q8_0"


def test_run_writes_ordered_records_and_metrics(tmp_path, loads):
    f = write(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x", "sampling_params": {"max_tokens": 3}},
                                      {"id": "b", "messages": [{"role": "user", "content": "hi"}]}])
    out, metrics = tmp_path / "out.jsonl", tmp_path / "m.json"
    result = runner.invoke(app, ["run", f, "-o", str(out), "--max-tokens", "1", "--kv-cache-memory", "1GiB",
                                 "--max-num-seqs", "4", "--no-enable-prefix-caching", "--metrics-json", str(metrics)])
    assert result.exit_code == 0, result.output
    assert loads == [("smollm2-135m-instruct", {"dtype": "auto", "max_num_seqs": 4, "enable_prefix_caching": False,
                                                "kv_cache_memory": 2**30})]
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert [(r["id"], len(r["outputs"][0]["token_ids"])) for r in recs] == [("a", 3), ("b", 1)]
    assert not (tmp_path / "out.jsonl.partial").exists()
    m = json.loads(metrics.read_text())
    assert m["num_requests"] == 2 and m["num_ok"] == 2 and m["generated_tokens"] == 4
    assert "vbatch run" in result.stderr  # the summary table


def test_failed_records_exit_1_and_keep_their_place(tmp_path, loads):
    f = write(tmp_path / "in.jsonl", [{"prompt": "x"}, {"prompt": 5}, {"prompt": "too long"}, {"prompt": "y"}])
    out = tmp_path / "out.parquet"
    result = runner.invoke(app, ["run", f, "-o", str(out), "--max-tokens", "1"])
    assert result.exit_code == 1
    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == ["1", "2", "3", "4"]
    assert [r["error"] is None for r in rows] == [True, False, False, True]
    assert rows[1]["error"] == f"{f}:2: prompt: must be a string, got number"


def test_strict_refuses_before_loading_the_model(tmp_path, loads):
    f = write(tmp_path / "in.jsonl", [{"prompt": "x"}, {"prompt": 5}])
    result = runner.invoke(app, ["run", f, "-o", str(tmp_path / "o.jsonl"), "--strict"])
    assert result.exit_code == 3 and loads == []
    assert f"{f}:2: prompt: must be a string, got number" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--kv-cache-memory", "lots"], "error: --kv-cache-memory: cannot read 'lots' as a size"),
    (["--temperature", "-1"], "error: --temperature: must be in [0, 2], got -1.0"),
    (["--chat-template", "nope.jinja"], "error: --chat-template: 'nope.jinja' is neither a file nor a Jinja template"),
    (["-o", "x.parquet"], "error: --output: OpenAI Batch input writes OpenAI Batch JSONL, not Parquet"),
])
def test_bad_options_exit_2_before_loading_the_model(tmp_path, loads, args, message):
    f = write(tmp_path / "b.jsonl", [{"custom_id": "c", "method": "POST", "url": "/v1/completions",
                                      "body": {"prompt": "x"}}])
    result = runner.invoke(app, ["run", f, "-o", str(tmp_path / "o.jsonl"), *args])
    assert result.exit_code == 2 and loads == []
    assert result.stderr.splitlines()[0].startswith(message)


def test_openai_run_to_stdout(tmp_path, loads):
    f = write(tmp_path / "b.jsonl", [
        {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2}},
        {"custom_id": "c2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 1}}])
    result = runner.invoke(app, ["run", f])
    assert result.exit_code == 0, result.stderr
    lines = [json.loads(l) for l in result.stdout.splitlines()]
    assert [l["custom_id"] for l in lines] == ["c1", "c2"]
    assert [l["response"]["body"]["object"] for l in lines] == ["chat.completion", "text_completion"]
    assert [l["response"]["body"]["usage"]["completion_tokens"] for l in lines] == [2, 1]
    assert lines[0]["response"]["body"]["model"] == "smollm2-135m-instruct"

"""`vbatch validate`: exit codes, problem lines on stdout, the count summary on stderr."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from vbatch.cli.main import app

runner = CliRunner()


def test_clean_file_exits_0(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "a"}, {"messages": [{"role": "user", "content": "b"}]}, {"prompt_token_ids": [1, 2]}]) + "\n")
    result = runner.invoke(app, ["validate", str(f)])
    assert result.exit_code == 0
    assert result.stdout == ""
    assert result.stderr.strip() == (f"{f}: 3 records (jsonl): 3 ok [1 messages, 1 prompt, 1 token_ids], "
                                     "0 with problems")


def test_problems_exit_3_with_file_line_field_message(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text('{"id": "a", "prompt": "x"}\n{oops\n{"id": "a", "prompt": "y"}\n'
                 '{"prompt": "z", "sampling_params": {"max_tokens": 0}}\n')
    result = runner.invoke(app, ["validate", str(f)])
    assert result.exit_code == 3
    assert result.stdout.splitlines() == [
        f"{f}:2: json: invalid JSON: Expecting property name enclosed in double quotes (column 2)",
        f"{f}:3: id: duplicate id 'a' (first on line 1)",
        f"{f}:4: sampling_params.max_tokens: must be an integer >= 1 or None, got 0",
    ]
    assert result.stderr.strip() == f"{f}: 4 records (jsonl): 1 ok [1 prompt], 3 with problems"


def test_openai_bad_url(tmp_path):
    f = tmp_path / "b.jsonl"
    f.write_text(json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {}}) + "\n")
    result = runner.invoke(app, ["validate", str(f)])
    assert result.exit_code == 3
    assert result.stdout.strip() == (f"{f}:1: url: unsupported url '/v1/embeddings'; "
                                     "vbatch serves /v1/chat/completions, /v1/completions (vbatch embed serves /v1/embeddings)")
    assert "(openai)" in result.stderr


def test_command_line_defaults_take_part(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text(json.dumps({"prompt": "a", "sampling_params": {"min_tokens": 30}}) + "\n")
    assert runner.invoke(app, ["validate", str(f)]).exit_code == 3
    assert runner.invoke(app, ["validate", str(f), "--max-tokens", "64"]).exit_code == 0


def test_stdin(tmp_path):
    result = runner.invoke(app, ["validate", "-"], input='{"prompt": "a"}\n{"prompt": 1}\n')
    assert result.exit_code == 3
    assert result.stdout.strip() == "<stdin>:2: prompt: must be a string, got number"

"""Every command as a real subprocess (`python -m vbatch.cli.main ...`): exit codes and messages.

No model is loaded: each `run` here stops at an error before the load, or at the model lookup
(exit 4). Model runs are in test_run_real_model.py / test_run_crash.py (slow).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def vbatch(*args, cwd=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    for name in ("VBATCH_SHARD", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "vbatch.cli.main", *map(str, args)], capture_output=True,
                          text=True, timeout=180, cwd=cwd, env=env)


@pytest.fixture
def files(tmp_path):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt_token_ids": [1, 2]}\n')
    bad.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": 5}\n{"id": "c\n')
    return good, bad


def test_validate(files):
    good, bad = files
    ok = vbatch("validate", good)
    assert ok.returncode == 0 and f"{good}: 2 records (jsonl): 2 ok" in ok.stderr
    found = vbatch("validate", bad)
    assert found.returncode == 3
    assert found.stdout.splitlines() == [f"{bad}:2: prompt: must be a string, got number",
                                         f"{bad}:3: json: invalid JSON: Invalid control character at (column 10)"]


def test_run_errors_before_the_model(files, tmp_path):
    good, bad = files
    missing = vbatch("run", tmp_path / "nope.jsonl", "-o", tmp_path / "o.jsonl")
    assert missing.returncode == 3 and f"error: {tmp_path / 'nope.jsonl'}: no such file" in missing.stderr
    option = vbatch("run", good, "-o", tmp_path / "o.jsonl", "--temperature", "9")
    assert option.returncode == 2 and "error: --temperature: must be in [0, 2], got 9.0" in option.stderr
    usage = vbatch("run", good, "--bogus")
    assert usage.returncode == 2 and "No such option" in usage.stderr
    shard = vbatch("run", good, "-o", tmp_path / "o.jsonl", "--shard", "2/2")
    assert shard.returncode == 2 and "error: --shard: needs 0 <= I < N, got 2/2" in shard.stderr
    fail = vbatch("run", bad, "-o", tmp_path / "o.jsonl", "--on-error", "fail")
    assert fail.returncode == 3 and "2 bad records; nothing was run" in fail.stderr
    foreign = tmp_path / "mine.jsonl"
    foreign.write_text("keep me\n")
    refused = vbatch("run", good, "-o", foreign)
    assert refused.returncode == 5 and f"error: {foreign} exists but has no manifest" in refused.stderr
    assert "hint: pass --overwrite to replace it" in refused.stderr
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "o.jsonl.partial").exists()


def test_run_model_not_found_exits_4(files, tmp_path):
    good, _ = files
    result = vbatch("run", good, "-o", tmp_path / "o.jsonl", "--model", tmp_path / "no-model")
    assert result.returncode == 4, result.stderr
    assert result.stderr.startswith("error: ") and "hint: " in result.stderr
    assert not (tmp_path / "o.jsonl.partial").exists()  # nothing written before the model loads


def test_merge_errors(tmp_path):
    none = vbatch("merge", tmp_path / "o.jsonl")
    assert none.returncode == 5 and f"error: no parts of {tmp_path / 'o.jsonl'} found" in none.stderr
    part = tmp_path / "o.jsonl.part-1-of-2"
    part.write_text(json.dumps({"id": "a"}) + "\n")
    lonely = vbatch("merge", part)
    assert lonely.returncode == 5
    assert "part 0 of 2 is missing" in lonely.stderr and "part 1 of 2 has no manifest" in lonely.stderr


def test_models_list_and_pull(tmp_path):
    listed = vbatch("models", "list")
    assert listed.returncode == 0 and "smollm2-135m-instruct" in listed.stdout
    missing = vbatch("models", "pull", tmp_path / "nothing-here")
    assert missing.returncode == 4 and missing.stderr.startswith("error: ")


def test_version_and_help():
    from vbatch import __version__
    assert vbatch("--version").stdout.strip() == f"vbatch {__version__}"
    merged = vbatch("merge", "--help")
    assert merged.returncode == 0 and "--input" in merged.stdout

"""Resume, overwrite, already-complete, torn lines and clean stops of `vbatch run`, with the engine
replaced by the runner tests' FakeLLM (a test double of vbatch.LLM's interface; real-model crash
tests are in test_run_crash.py). The oracle is always the same command run without interruption."""
from __future__ import annotations

import json
import os
import signal

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from test_batch_runner import FakeLLM  # noqa: E402  (tests/ is on sys.path under pytest)
from vbatch.batch.resume import trim_partial
from vbatch.cli import run as run_cmd
from vbatch.cli.main import app
from vbatch.cli.signals import StopSignals

runner = CliRunner()
ARGS = ["--max-tokens", "1", "--max-num-seqs", "2", "--max-in-flight", "2"]


class StoppingLLM(FakeLLM):
    """FakeLLM whose engine calls `action()` at its `after`-th step (a crash or a signal mid-run)."""

    def __init__(self, after, action):
        super().__init__()
        step, count = self.engine.step, [0]

        def stepping():
            count[0] += 1
            if count[0] == after:
                action()
            return step()

        self.engine.step = stepping


@pytest.fixture
def loads(monkeypatch):
    """Which LLM the next `vbatch run` gets: set `loads.next` to a factory; records every load."""
    class Loads(list):
        next = FakeLLM

    calls = Loads()

    def fake_load(model, kwargs):
        calls.append(model)
        return calls.next()

    monkeypatch.setattr(run_cmd, "load_llm", fake_load)
    return calls


def records(n, bad=()):
    out = []
    for i in range(n):
        if i in bad:
            out.append('{"id": "r%d", "prompt": 5}' % i)
        else:
            out.append(json.dumps({"id": f"r{i}", "prompt": f"p{i}", "sampling_params": {"max_tokens": 1 + i % 3}}))
    return "\n".join(out) + "\n"


def stable(path):
    """The output records minus what legitimately differs between two runs (timings)."""
    with open(path, "rb") as f:
        is_parquet = f.read(4) == b"PAR1"
    if is_parquet:
        rows = pq.read_table(path).to_pylist()
    else:
        rows = [json.loads(line) for line in open(path)]
    for r in rows:
        r.pop("metrics", None)
        if "response" in r:  # OpenAI lines: random ids and creation times
            r.pop("id")
            r["response"].pop("request_id")
            if r["response"]["body"]:
                r["response"]["body"].pop("id")
                r["response"]["body"].pop("created")
    return rows


def invoke(*args, env=None):
    return runner.invoke(app, ["run", *map(str, args), *ARGS], env=env)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_interrupted_run_resumes_to_the_uninterrupted_output(tmp_path, loads, suffix):
    inp = tmp_path / "in.jsonl"
    inp.write_text(records(12, bad={4}))
    ref, out = tmp_path / f"ref{suffix}", tmp_path / f"out{suffix}"
    assert invoke(inp, "-o", ref).exit_code == 1  # one bad record

    def crash():
        raise KeyboardInterrupt

    loads.next = lambda: StoppingLLM(5, crash)
    first = invoke(inp, "-o", out)
    assert first.exit_code == 130 and "rerun the same command to resume" in first.stderr
    partial = tmp_path / f"out{suffix}.partial"
    assert not out.exists() and partial.exists()
    done = partial.read_text().splitlines()
    assert 0 < len(done) < 12
    # A kill mid-write leaves a torn line: the resume cuts it away.
    with open(partial, "a") as f:
        f.write('{"id": "r99", "outp')
    loads.next = FakeLLM
    second = invoke(inp, "-o", out)
    assert second.exit_code == 1, second.output
    assert f"resuming after {len(done)} records already done (cut a torn last line of 19 bytes)" in second.stderr
    assert stable(out) == stable(ref)
    assert [r["id"] for r in stable(out)] == [f"r{i}" for i in range(12)]
    assert json.loads((tmp_path / f"out{suffix}.manifest.json").read_text())["state"] == "complete"


def test_complete_output_is_not_run_again(tmp_path, loads):
    inp = tmp_path / "in.jsonl"
    inp.write_text(records(3))
    out = tmp_path / "out.jsonl"
    assert invoke(inp, "-o", out).exit_code == 0
    before = out.read_bytes()
    again = invoke(inp, "-o", out)
    assert again.exit_code == 0 and "already complete (3 records); nothing to do" in again.stderr
    assert len(loads) == 1 and out.read_bytes() == before  # no second model load, nothing written


def test_openai_batch_resume(tmp_path, loads):
    inp = tmp_path / "batch.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                       "body": {"prompt": f"p{i}", "max_tokens": 1 + i % 2}}) + "\n"
                           for i in range(6)))
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert invoke(inp, "-o", ref).exit_code == 0

    def crash():
        raise KeyboardInterrupt

    loads.next = lambda: StoppingLLM(3, crash)
    assert invoke(inp, "-o", out).exit_code == 130
    loads.next = FakeLLM
    assert invoke(inp, "-o", out).exit_code == 0
    assert stable(out) == stable(ref)


def test_output_of_another_run_is_refused_until_overwrite(tmp_path, loads):
    inp, other = tmp_path / "in.jsonl", tmp_path / "other.jsonl"
    inp.write_text(records(3))
    other.write_text(records(4))
    out = tmp_path / "out.jsonl"
    assert invoke(inp, "-o", out).exit_code == 0
    changed = invoke(inp, "-o", out, "--temperature", "0.5")
    assert changed.exit_code == 5
    assert (f"error: {out} belongs to another run: option sampling_defaults: {{'max_tokens': 1}} then, "
            f"{{'max_tokens': 1, 'temperature': 0.5}} now") in changed.stderr
    assert "hint: rerun with the same input and options to resume, pass --overwrite" in changed.stderr
    moved = invoke(other, "-o", out)
    assert moved.exit_code == 5 and "belongs to another run: input: written for" in moved.stderr
    assert len(loads) == 1  # refused before loading the model
    assert invoke(other, "-o", out, "--overwrite").exit_code == 0
    assert [r["id"] for r in stable(out)] == ["r0", "r1", "r2", "r3"]


def test_overwrite_keeps_the_old_output_when_validation_fails(tmp_path, loads):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(records(3))
    bad.write_text(records(3, bad=(1,)))
    out = tmp_path / "out.jsonl"
    assert invoke(good, "-o", out).exit_code == 0
    before = out.read_bytes()
    refused = invoke(bad, "-o", out, "--overwrite", "--on-error", "fail")
    assert refused.exit_code == 3
    assert out.read_bytes() == before       # nothing removed: the run stopped before replacing it


def test_foreign_file_and_no_resume_are_refused(tmp_path, loads):
    inp = tmp_path / "in.jsonl"
    inp.write_text(records(3))
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    foreign = invoke(inp, "-o", out)
    assert foreign.exit_code == 5
    assert f"error: {out} exists but has no manifest ({out}.manifest.json)" in foreign.stderr
    assert out.read_text() == "precious\n"
    out.unlink()

    def crash():
        raise KeyboardInterrupt

    loads.next = lambda: StoppingLLM(2, crash)
    assert invoke(inp, "-o", out).exit_code == 130
    refused = invoke(inp, "-o", out, "--no-resume")
    assert refused.exit_code == 5 and "holds an unfinished run and --no-resume was given" in refused.stderr


def test_partial_of_another_input_with_same_identity_is_caught_by_ids(tmp_path, loads):
    inp = tmp_path / "in.jsonl"
    inp.write_text(records(4))
    out = tmp_path / "out.jsonl"

    def crash():
        raise KeyboardInterrupt

    loads.next = lambda: StoppingLLM(3, crash)
    assert invoke(inp, "-o", out).exit_code == 130
    partial = tmp_path / "out.jsonl.partial"
    lines = partial.read_text().splitlines()
    first = json.loads(lines[0])
    first["id"] = "zz"
    partial.write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    loads.next = FakeLLM
    bad = invoke(inp, "-o", out)
    assert bad.exit_code == 5
    assert f"{partial}:1: holds id 'zz' where the input's record 1 (line 1) has 'r0'" in bad.stderr


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_cleanly_and_keeps_the_partial_resumable(tmp_path, loads, signum, code):
    inp = tmp_path / "in.jsonl"
    inp.write_text(records(10))
    out, ref = tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    assert invoke(inp, "-o", ref).exit_code == 0
    loads.next = lambda: StoppingLLM(4, lambda: os.kill(os.getpid(), signum))
    stopped = invoke(inp, "-o", out)
    assert stopped.exit_code == code, stopped.output
    assert f"stopped by {signal.Signals(signum).name}" in stopped.stderr and "interrupted" in stopped.stderr
    written = (tmp_path / "out.jsonl.partial").read_text().splitlines()
    assert 0 < len(written) < 10 and trim_partial(str(tmp_path / "out.jsonl.partial")) == (len(written), 0, 0)
    loads.next = FakeLLM
    assert invoke(inp, "-o", out).exit_code == 0
    assert stable(out) == stable(ref)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


def test_stop_signals_second_ctrl_c_raises():
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.is_set() and stop.exit_code == 130
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_on_error_fail_and_strict_alias_stop_before_the_model(tmp_path, loads):
    inp = tmp_path / "in.jsonl"
    inp.write_text(records(3, bad={1}))
    for flag in (["--on-error", "fail"], ["--strict"]):
        result = invoke(inp, "-o", tmp_path / "o.jsonl", *flag)
        assert result.exit_code == 3 and loads == []
        assert f"{inp}:2: prompt: must be a string, got number" in result.stderr
        assert "1 bad records; nothing was run" in result.stderr
    wrong = invoke(inp, "--on-error", "skip")
    assert wrong.exit_code == 2 and "error: --on-error: must be record or fail, got 'skip'" in wrong.stderr
    piped = runner.invoke(app, ["run", "-", "--on-error", "fail"], input=records(1))
    assert piped.exit_code == 2 and "fail needs a file: stdin cannot be read twice" in piped.stderr


def test_record_mode_reports_problems_first_and_lists_them_in_the_summary(tmp_path, loads):
    inp = tmp_path / "in.jsonl"
    inp.write_text(records(4, bad={1, 3}))
    result = invoke(inp, "-o", tmp_path / "o.jsonl", "--metrics-json", tmp_path / "m.json")
    assert result.exit_code == 1
    err = result.stderr
    assert err.index(f"{inp}:2: prompt: must be a string") < err.index("2 bad records: each gets an error record")
    assert f"errors (first 2 of 2):\n  id 'r1': {inp}:2: prompt: must be a string, got number\n  id 'r3':" in err
    m = json.loads((tmp_path / "m.json").read_text())
    assert (m["num_requests"], m["num_errors"], m["interrupted"], m["num_resumed"]) == (4, 2, False, 0)

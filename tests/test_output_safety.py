"""Outputs overlapping runs and file-system faults cannot corrupt (issue 12, first part): one writer per
output (an flock held for the run, gone with its holder), inputs as users have them (BOM, CRLF, gzip,
zstd, stdin, empty), a missing output folder refused before the model loads, a full disk a clear
error whose partial output resumes once there is room."""
from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from vbatch.batch.output_lock import OutputLockedError, lock_path, output_lock
from vbatch.cli import run as run_cmd
from vbatch.cli.main import app

from test_batch_runner import FakeLLM  # noqa: E402  (tests/ is on sys.path under pytest)

runner = CliRunner()
RECORDS = [{"id": f"r{i}", "prompt": f"prompt number {i} " + "word " * (i % 7),
            "sampling_params": {"max_tokens": 3 + i % 4}} for i in range(30)]


@pytest.fixture
def loads(monkeypatch):
    calls = []

    def fake_load(model, kwargs):
        calls.append(model)
        return FakeLLM()

    monkeypatch.setattr(run_cmd, "load_llm", fake_load)
    return calls


def jsonl(records, newline="\n"):
    return "".join(json.dumps(r) + newline for r in records)


# ---------------------------------------------------------------------------- the lock
def test_a_held_lock_refuses_a_second_run_naming_the_holder(tmp_path, loads):
    inp = tmp_path / "in.jsonl"
    inp.write_text(jsonl(RECORDS[:3]))
    out = tmp_path / "out.jsonl"
    with output_lock(str(out)):
        r = runner.invoke(app, ["run", str(inp), "-o", str(out)])
        assert r.exit_code == 6, r.output
        assert f"pid {os.getpid()}" in r.output and "another run is writing this output" in r.output
        assert "--wait-lock" in r.output
        with pytest.raises(OutputLockedError):
            with output_lock(str(out)):
                pass
    assert loads == [] and not out.exists()
    assert not os.path.exists(lock_path(str(out)))           # released: the file is gone too
    r = runner.invoke(app, ["run", str(inp), "-o", str(out)])
    assert r.exit_code == 0 and len(out.read_text().splitlines()) == 3
    assert not os.path.exists(lock_path(str(out)))


HOLD = """
import sys, time
from vbatch.batch.output_lock import output_lock
with output_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_the_lock_dies_with_a_killed_holder_and_wait_lock_queues(tmp_path, loads):
    out = tmp_path / "out.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(OutputLockedError, match=f"pid {holder.pid}"):
        with output_lock(str(out)):
            pass
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert os.path.exists(lock_path(str(out)))                # a stale file nobody holds...
    with output_lock(str(out)):                               # ...taken at once, no cleanup needed
        pass
    assert not os.path.exists(lock_path(str(out)))
    # --wait-lock: a second holder that lets go after a moment; the run waits, then proceeds
    holder = subprocess.Popen([sys.executable, "-c", HOLD.replace("600", "1.5"), str(out)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    inp = tmp_path / "in.jsonl"
    inp.write_text(jsonl(RECORDS[:2]))
    t0 = time.monotonic()
    r = runner.invoke(app, ["run", str(inp), "-o", str(out), "--wait-lock"])
    assert r.exit_code == 0, r.output
    assert time.monotonic() - t0 > 0.5 and len(out.read_text().splitlines()) == 2
    holder.wait()


@pytest.mark.slow
def test_two_overlapping_real_runs_one_proceeds_the_other_is_refused(tmp_path):
    """The cron case of the issue: `vbatch run` started twice on one output with the real default model."""
    inp = tmp_path / "cron.jsonl"
    inp.write_text(jsonl([{"id": f"q{i}", "prompt": f"Count to {i}:", "sampling_params": {"max_tokens": 24,
                                                                                         "temperature": 0}}
                          for i in range(24)]))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "vbatch.cli.main", "run", str(inp), "-o", str(out)]
    env = dict(os.environ, VBATCH_NUM_THREADS="1")
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(lock_path(str(out))) and time.monotonic() < deadline:
        time.sleep(0.05)
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-2000:]
    assert second.returncode == 6 and f"pid {first.pid}" in second.stderr, second.stderr[-2000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == [f"q{i}" for i in range(24)] and all(r["error"] is None for r in lines)
    assert not os.path.exists(lock_path(str(out))) and not os.path.exists(str(out) + ".partial")


# ---------------------------------------------------------------------------- inputs as users have them
def test_bom_crlf_gzip_zstd_and_stdin_read_as_the_plain_file(tmp_path, loads):
    import zstandard

    plain = tmp_path / "plain.jsonl"
    plain.write_text(jsonl(RECORDS[:8]))
    variants = {"bom_crlf.jsonl": b"\xef\xbb\xbf" + jsonl(RECORDS[:8], "\r\n").encode()}
    variants["blank_no_last_newline.jsonl"] = ("\n\n" + jsonl(RECORDS[:8]).replace("\n", "\n\n")).rstrip().encode()
    variants["g.jsonl.gz"] = gzip.compress(plain.read_bytes())
    variants["z.jsonl.zst"] = zstandard.ZstdCompressor().compress(plain.read_bytes())
    assert runner.invoke(app, ["run", str(plain), "-o", str(tmp_path / "want.jsonl")]).exit_code == 0
    want = [json.loads(x) for x in (tmp_path / "want.jsonl").read_text().splitlines()]

    def ids_and_text(lines):
        return [(r["id"], r["outputs"][0]["text"] if r.get("outputs") else r) for r in lines]
    for name, data in variants.items():
        (tmp_path / name).write_bytes(data)
        r = runner.invoke(app, ["run", str(tmp_path / name), "-o", str(tmp_path / f"{name}.out.jsonl")])
        assert r.exit_code == 0, (name, r.output)
        got = [json.loads(x) for x in (tmp_path / f"{name}.out.jsonl").read_text().splitlines()]
        assert ids_and_text(got) == ids_and_text(want), name
    r = runner.invoke(app, ["run", "-", "-o", str(tmp_path / "stdin.out.jsonl")], input=variants["bom_crlf.jsonl"])
    assert r.exit_code == 0, r.output
    got = [json.loads(x) for x in (tmp_path / "stdin.out.jsonl").read_text().splitlines()]
    assert ids_and_text(got) == ids_and_text(want)


def test_a_truncated_gzip_is_a_clear_error(tmp_path, loads):
    data = gzip.compress(jsonl(RECORDS).encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    r = runner.invoke(app, ["run", str(tmp_path / "cut.jsonl.gz"), "-o", str(tmp_path / "o.jsonl")])
    assert r.exit_code == 3 and "cannot decompress" in r.output and "truncated or damaged" in r.output


def test_an_empty_input_answers_zero_records_without_the_model(tmp_path, loads):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    out = tmp_path / "out.jsonl"
    r = runner.invoke(app, ["run", str(tmp_path / "empty.jsonl"), "-o", str(out)])
    assert r.exit_code == 0 and "0 records" in r.output and loads == []
    assert out.read_text() == ""
    r = runner.invoke(app, ["run", str(tmp_path / "empty.jsonl"), "-o", str(out)])
    assert r.exit_code == 0 and "already complete" in r.output


def test_an_output_folder_that_does_not_exist_is_refused_before_the_model(tmp_path, loads):
    (tmp_path / "in.jsonl").write_text(jsonl(RECORDS[:2]))
    r = runner.invoke(app, ["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "nope" / "out.jsonl")])
    assert r.exit_code == 2 and "does not exist" in r.output and "Traceback" not in r.output
    assert loads == []


# ---------------------------------------------------------------------------- a full disk
@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or 'not root'}): the ENOSPC test needs one")
    yield mnt
    subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_full_disk_stops_with_a_clear_error_and_the_rerun_completes(tmp_path, loads, small_disk):
    records = [dict(r, prompt=r["prompt"] + "x" * 300) for r in RECORDS * 1]
    inp = tmp_path / "in.jsonl"
    inp.write_text(jsonl(records))
    assert runner.invoke(app, ["run", str(inp), "-o", str(tmp_path / "want.jsonl")]).exit_code == 0
    out = small_disk / "out.jsonl"
    r = runner.invoke(app, ["run", str(inp), "-o", str(out)])
    assert r.exit_code == 7, r.output
    assert "the disk is full" in r.output and "rerun the same command" in r.output and "Traceback" not in r.output
    assert os.path.exists(str(out) + ".partial") and not out.exists()
    subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True)
    r = runner.invoke(app, ["run", str(inp), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_text() == (tmp_path / "want.jsonl").read_text()


def test_merge_holds_the_parts_it_reads(tmp_path, loads):
    inp = tmp_path / "in.jsonl"
    inp.write_text(jsonl(RECORDS[:6]))
    out = tmp_path / "out.jsonl"
    for i in range(2):
        assert runner.invoke(app, ["run", str(inp), "-o", str(out), "--shard", f"{i}/2"]).exit_code == 0
    with output_lock(f"{out}.part-1-of-2"):
        r = runner.invoke(app, ["merge", str(out)])
        assert r.exit_code == 6 and "part-1-of-2" in r.output and "another run is writing this part" in r.output
    r = runner.invoke(app, ["merge", str(out)])
    assert r.exit_code == 0, r.output
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == [f"r{i}" for i in range(6)]
    assert not list(tmp_path.glob("*.lock"))


def test_a_media_part_for_a_text_only_model_is_a_record_error_and_the_rest_are_answered(tmp_path, loads):
    recs = [{"id": "a", "messages": [{"role": "user", "content": "hi"}]},       # (the fake joins strings)
            {"id": "b", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]},
            {"id": "c", "messages": [{"role": "user", "content": [{"type": "hologram", "x": 1}]}]},
            {"id": "d", "prompt": "plain"}]
    (tmp_path / "in.jsonl").write_text(jsonl(recs))
    out = tmp_path / "out.jsonl"
    r = runner.invoke(app, ["run", str(tmp_path / "in.jsonl"), "-o", str(out)])
    assert r.exit_code == 1 and out.exists(), r.output
    got = {x["id"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert got["a"]["error"] is None and got["d"]["error"] is None
    assert "messages[0].content[1]" in got["b"]["error"] and "'image_url'" in got["b"]["error"]
    assert "reads text only" in got["b"]["error"] and "media" in got["b"]["error"]
    assert "'hologram'" in got["c"]["error"] and "unknown" in got["c"]["error"]
    assert "in.jsonl:2: messages[0].content[1]" in r.output          # listed before the model loads


def test_the_chat_api_names_the_model_for_a_media_part():
    from vbatch.engine.errors import InputError
    from vbatch.engine.tokenizer import apply_chat_template

    class Tok:
        name_or_path = "smollm2-135m-instruct"
    with pytest.raises(InputError, match=r"messages\[0\].content\[0\]: is a media content part \('input_audio'\); "
                                         r"smollm2-135m-instruct reads text only"):
        apply_chat_template(Tok(), [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
                            chat_template=None, add_generation_prompt=True, continue_final_message=False)


def test_an_input_rewritten_during_the_run_leaves_the_output_unfinished(tmp_path, monkeypatch):
    inp = tmp_path / "in.jsonl"
    inp.write_text(jsonl(RECORDS[:6]))

    class Rewriting(FakeLLM):
        def stream(self, requests, **kw):
            for i, item in enumerate(super().stream(requests, **kw)):
                if i == 2:
                    with open(inp, "a") as f:          # another program appends while vbatch reads
                        f.write(jsonl(RECORDS[6:8]))
                yield item
    monkeypatch.setattr(run_cmd, "load_llm", lambda model, kwargs: Rewriting())
    out = tmp_path / "out.jsonl"
    r = runner.invoke(app, ["run", str(inp), "-o", str(out)])
    assert r.exit_code == 3 and "changed while this run read it" in r.output, r.output
    assert not out.exists() and os.path.exists(str(out) + ".partial")
    monkeypatch.setattr(run_cmd, "load_llm", lambda model, kwargs: FakeLLM())
    r = runner.invoke(app, ["run", str(inp), "-o", str(out)])
    assert r.exit_code == 5 and "belongs to another run" in r.output          # the final file is another input
    r = runner.invoke(app, ["run", str(inp), "-o", str(out), "--overwrite"])
    assert r.exit_code == 0 and len(out.read_text().splitlines()) == 8


def test_a_read_only_output_folder_is_refused_before_the_model(tmp_path, loads, small_disk):
    (tmp_path / "in.jsonl").write_text(jsonl(RECORDS[:2]))
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    r = runner.invoke(app, ["run", str(tmp_path / "in.jsonl"), "-o", str(small_disk / "out.jsonl")])
    assert r.exit_code == 2 and "Read-only file system" in r.output and "Traceback" not in r.output, r.output
    assert loads == []

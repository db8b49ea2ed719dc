"""Crash safety on the real model (slow, about a minute: five process starts).

`vbatch run` is started as a subprocess and killed with SIGKILL three times at random moments after
it has started writing (the partial's size is polled), each time rerun with the same command; a
last rerun finishes. Oracle: the same command run once without interruption. Every id must be in
the output exactly once, in input order, with identical text and token ids (greedy).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow
NUM_RECORDS = 40
NUM_KILLS = 3
FLAGS = ["--temperature", "0", "--max-tokens", "8", "--dtype", "float32", "--max-model-len", "256",
         "--kv-cache-memory", "64MiB", "--max-num-seqs", "4", "--max-in-flight", "4"]


def command(inp, out):
    return [sys.executable, "-m", "vbatch.cli.main", "run", str(inp), "-o", str(out), *FLAGS]


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def size(path):
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return -1


def stable(path):
    rows = [json.loads(line) for line in open(path)]
    for r in rows:
        r.pop("metrics")
    return rows


def test_kill_9_at_random_moments_then_resume_equals_an_uninterrupted_run(tmp_path):
    rng = random.Random(20260)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Item {i}: the number {i * 7} is"}) + "\n"
                           for i in range(NUM_RECORDS)))
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    done = subprocess.run(command(inp, ref), env=env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]

    partial = tmp_path / "out.jsonl.partial"
    kills, lines_after_kill = 0, []
    while kills < NUM_KILLS:
        before = size(partial)
        proc = subprocess.Popen(command(inp, out), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 900
        while size(partial) <= max(before, 0) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.4))
        if proc.poll() is not None:
            pytest.fail(f"the run ended before kill {kills + 1}: {proc.stderr.read().decode()[-2000:]}")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
        kills += 1
        assert not out.exists()
        with open(partial, "rb") as f:
            lines_after_kill.append(f.read().count(b"\n"))
    assert lines_after_kill == sorted(lines_after_kill) and lines_after_kill[-1] < NUM_RECORDS
    last = subprocess.run(command(inp, out), env=env(), capture_output=True, text=True, timeout=900)
    assert last.returncode == 0, last.stderr[-2000:]
    assert "resuming after" in last.stderr
    rows = stable(out)
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(NUM_RECORDS)]  # every id once, in order
    assert rows == stable(ref)  # text, token ids, request ids, everything but timings
    assert not partial.exists()
    print("lines after each kill:", lines_after_kill)

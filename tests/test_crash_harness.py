"""Crash-test harness (SQLite-style): `vbatch run` / `vbatch merge` killed with SIGKILL at every named
point (batch/crash_points.py: after the k-th record, before and after the final rename, during the
manifest write, the Parquet conversion and the merge) and at random records, resumed each time,
sometimes killed again while resuming. After every resume: the output is byte-identical to an
uninterrupted run, each id appears once, no partial, lock or temporary file is left.

The runs are real `vbatch` processes whose model is the runner tests' FakeLLM (deterministic, no
model load), so many kills fit in CI; tests/test_run_crash.py kills the real model at random
moments. `VBATCH_CRASH_ROUNDS=N` runs N random kill rounds instead of the CI's few (the long
version; docs/cli.md records its figures).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

TESTS = Path(__file__).resolve().parent
DRIVER = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from test_batch_runner import FakeLLM
from vbatch.cli import run as run_cmd
run_cmd.load_llm = lambda model, kwargs: FakeLLM()
from vbatch.cli.main import main
sys.argv = ["vbatch"] + sys.argv[1:]
main()
"""
NUM_RECORDS = 40
ROUNDS = int(os.environ.get("VBATCH_CRASH_ROUNDS", "3"))
STRAY = (".partial", ".lock", ".tmp", ".converting")


def vbatch(args, crash_at=None):
    env = {k: v for k, v in os.environ.items() if k != "VBATCH_CRASH_AT"}
    if crash_at:
        env["VBATCH_CRASH_AT"] = crash_at
    return subprocess.run([sys.executable, "-c", DRIVER, *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    folder = tmp_path_factory.mktemp("crash")
    records = [{"id": f"r{i:02d}", "prompt": f"record {i} " + "w " * (i % 9),
                "sampling_params": {"max_tokens": 2 + i % 5}} for i in range(NUM_RECORDS)]
    (folder / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    refs = {}
    for suffix in ("jsonl", "parquet"):
        out = folder / f"ref.{suffix}"
        assert vbatch(["run", folder / "in.jsonl", "-o", out]).returncode == 0
        refs[suffix] = out
    return folder, refs


def check_invariants(out: Path, ref: Path) -> None:
    if out.suffix == ".parquet":
        assert pq.read_table(out).to_pylist() == pq.read_table(ref).to_pylist()
    else:
        assert out.read_bytes() == ref.read_bytes()
        ids = [json.loads(x)["id"] for x in out.read_text().splitlines()]
        assert ids == [f"r{i:02d}" for i in range(NUM_RECORDS)]
    stray = [p.name for p in out.parent.iterdir() if p.name.startswith(out.name) and p.name.endswith(STRAY)]
    assert not stray, stray


def crash_then_resume(args, out, ref, points):
    """Kill at each point in turn (each resume killed at the next), then resume to the end."""
    for point in points:
        r = vbatch(args, crash_at=point)
        if r.returncode == 0:            # the point lies past this run's work (a resume had little left)
            break
        assert r.returncode == -9, (point, r.returncode, r.stderr[-1500:])
    r = vbatch(args)
    assert r.returncode == 0, r.stderr[-1500:]
    check_invariants(out, ref)


NAMED = ["record.written:1", "record.written:20", f"record.written:{NUM_RECORDS}", "commit.before_rename",
         "commit.after_rename", "manifest.before_rename:1", "manifest.before_rename:2"]


# The named points on a JSONL output, and on a Parquet output with the Parquet writer's own point.
KILLS = [("jsonl", point) for point in NAMED] + [
    ("parquet", point) for point in ("record.written:13", "parquet.before_rename", "manifest.before_rename:2")]


@pytest.mark.parametrize("fmt,point", KILLS, ids=[f"{fmt}-{point}" for fmt, point in KILLS])
def test_a_kill_at_each_named_point_resumes_to_the_uninterrupted_output(work, fmt, point, tmp_path):
    folder, refs = work
    out = tmp_path / f"out.{fmt}"
    crash_then_resume(["run", folder / "in.jsonl", "-o", out], out, refs[fmt], [point])


def test_random_kills_chained_across_resumes(work, tmp_path):
    folder, refs = work
    rng = random.Random(1234)
    kills = 0
    for round_ in range(ROUNDS):
        out = tmp_path / f"out{round_}.jsonl"
        points = [f"record.written:{rng.randint(1, NUM_RECORDS // 2)}" for _ in range(rng.randint(1, 3))]
        points += rng.sample(["commit.before_rename", "commit.after_rename", "manifest.before_rename:2"], 1)
        crash_then_resume(["run", folder / "in.jsonl", "-o", out], out, refs["jsonl"], points)
        kills += len(points)
    print(f"{ROUNDS} rounds, {kills} kills, {ROUNDS * NUM_RECORDS} records checked")


def test_shards_and_merge_survive_kills(work, tmp_path):
    folder, _ = work
    ref = tmp_path / "ref" / "out.jsonl"          # the same shards merged without a kill (engine request ids
    ref.parent.mkdir()                            # and cache counters are per shard run)
    for i in range(2):
        assert vbatch(["run", folder / "in.jsonl", "-o", ref, "--shard", f"{i}/2"]).returncode == 0
    assert vbatch(["merge", ref]).returncode == 0
    out = tmp_path / "out.jsonl"
    for i, point in enumerate(["record.written:7", "commit.after_rename"]):
        args = ["run", folder / "in.jsonl", "-o", out, "--shard", f"{i}/2"]
        assert vbatch(args, crash_at=point).returncode == -9
        assert vbatch(args).returncode == 0
    for point in ["merge.before_commit", "commit.before_rename", "manifest.before_rename"]:
        assert vbatch(["merge", out], crash_at=point).returncode == -9, point
    r = vbatch(["merge", out])
    assert r.returncode == 0, r.stderr[-1500:]
    check_invariants(out, ref)
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(STRAY)]

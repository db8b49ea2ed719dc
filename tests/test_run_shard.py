"""Shards (`--shard`, VBATCH_SHARD, Slurm array variables) and `vbatch merge`, with the engine replaced
by the runner tests' FakeLLM (test double). Oracle: the unsharded run of the same command.
The real-model version is in test_run_real_model.py."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from test_batch_runner import FakeLLM  # noqa: E402
from test_run_resume import StoppingLLM, records, stable  # noqa: E402
from vbatch.batch.shard import Shard, parse_shard, part_path, resolve_shard, split_part_path
from vbatch.cli import run as run_cmd
from vbatch.cli.main import app
from vbatch.engine.errors import ConfigError

runner = CliRunner()
ARGS = ["--max-tokens", "1", "--max-num-seqs", "2"]
NO_ENV = {"VBATCH_SHARD": "", "SLURM_ARRAY_TASK_ID": "", "SLURM_ARRAY_TASK_COUNT": ""}


@pytest.fixture(autouse=True)
def fake_llm(monkeypatch):
    for name in ("VBATCH_SHARD", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN",
                 "SLURM_ARRAY_TASK_STEP"):
        monkeypatch.delenv(name, raising=False)
    nxt = {"llm": FakeLLM}
    monkeypatch.setattr(run_cmd, "load_llm", lambda model, kwargs: nxt["llm"]())
    return nxt


def run(*args, env=None):
    return runner.invoke(app, ["run", *map(str, args), *ARGS], env=env)


def merge(*args):
    return runner.invoke(app, ["merge", *map(str, args)])


# ---------------------------------------------------------------- shard spec
def test_parse_and_resolve_shard():
    assert parse_shard("2/3") == Shard(2, 3, "--shard")
    for bad, msg in (("3/3", "needs 0 <= I < N, got 3/3"), ("1/0", "needs 0 <= I < N"),
                     ("a/b", "expected I/N (e.g. 0/4), got 'a/b'")):
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            parse_shard(bad)
    assert resolve_shard(None, {}).is_whole
    assert resolve_shard(None, {"VBATCH_SHARD": "1/4"}) == Shard(1, 4, "VBATCH_SHARD")
    slurm = {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "5", "SLURM_ARRAY_TASK_COUNT": "3"}
    assert resolve_shard(None, slurm) == Shard(2, 3, "SLURM_ARRAY_TASK_ID")
    stepped = {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_STEP": "2",
               "SLURM_ARRAY_TASK_COUNT": "3"}
    assert resolve_shard(None, stepped).spec() == "2/3"
    assert resolve_shard("0/2", {"VBATCH_SHARD": "1/4", **slurm}).spec() == "0/2"  # the flag wins
    assert resolve_shard(None, {"VBATCH_SHARD": "1/4", **slurm}).spec() == "1/4"
    assert list(Shard(1, 3, "x").select(range(10))) == [1, 4, 7]
    assert part_path("o.jsonl", Shard(1, 3, "x")) == "o.jsonl.part-1-of-3"
    assert part_path("o.jsonl", Shard(0, 1, "x")) == "o.jsonl"
    assert split_part_path("a/o.jsonl.part-12-of-30") == ("a/o.jsonl", 12, 30)
    assert split_part_path("o.jsonl.part-1-of-3.partial") is None


# ---------------------------------------------------------------- run shards, merge
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_three_shards_merge_to_the_unsharded_output(tmp_path, suffix):
    inp = tmp_path / "in.jsonl"
    inp.write_text(records(10, bad={5}))
    ref, out = tmp_path / f"ref{suffix}", tmp_path / f"out{suffix}"
    assert run(inp, "-o", ref).exit_code == 1
    for i, env in enumerate([{"VBATCH_SHARD": "0/3"},
                             {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "3"},
                             None]):
        args = ["--shard", "2/3"] if env is None else []
        result = run(inp, "-o", out, *args, env=env)
        assert result.exit_code in (0, 1), result.output
        assert f"-> {out}.part-{i}-of-3" in result.stderr
    assert [r["id"] for r in stable(f"{out}.part-1-of-3")] == ["r1", "r4", "r7"]
    merged = merge(out, "--input", inp)
    assert merged.exit_code == 0, merged.output
    assert f"{out}: 10 records merged from 3 parts" in merged.stderr
    strip = lambda rows: [{k: v for k, v in r.items() if k != "request_id"} for r in rows]  # noqa: E731
    assert strip(stable(out)) == strip(stable(ref))
    # Merging again, or running the unsharded command on the merged output, does nothing.
    assert "already complete (10 records)" in merge(out).stderr
    again = run(inp, "-o", out)
    assert again.exit_code == 0 and "already complete (10 records); nothing to do" in again.stderr


def test_merge_accepts_the_shell_glob_of_parts(tmp_path, fake_llm):
    inp = tmp_path / "in.jsonl"
    inp.write_text(records(5))
    out = tmp_path / "o.jsonl"
    for i in range(2):
        assert run(inp, "-o", out, "--shard", f"{i}/2").exit_code == 0
    parts = sorted(str(p) for p in tmp_path.glob("o.jsonl.part-*"))  # manifests included, as `ls` lists them
    assert any(p.endswith(".manifest.json") for p in parts)
    assert merge(*parts).exit_code == 0
    assert [r["id"] for r in stable(out)] == [f"r{i}" for i in range(5)]


def test_merge_names_missing_and_incomplete_parts(tmp_path, fake_llm):
    inp = tmp_path / "in.jsonl"
    inp.write_text(records(12))
    out = tmp_path / "o.jsonl"
    assert run(inp, "-o", out, "--shard", "0/4").exit_code == 0

    def crash():
        raise KeyboardInterrupt

    fake_llm["llm"] = lambda: StoppingLLM(1, crash)  # stopped before its first record
    assert run(inp, "-o", out, "--shard", "2/4").exit_code == 130
    result = merge(out)
    assert result.exit_code == 5
    assert f"part 1 of 4 is missing (no {out}.part-1-of-4; run shard 1/4)" in result.stderr
    assert (f"part 2 of 4 is incomplete ({out}.part-2-of-4.partial holds 0 records; rerun shard 2/4 to finish it)"
            in result.stderr)
    assert "part 3 of 4 is missing" in result.stderr and not out.exists()
    none = merge(tmp_path / "nothing.jsonl")
    assert none.exit_code == 5 and "no parts of" in none.stderr


def test_merge_refuses_mixed_splits_other_input_and_duplicate_ids(tmp_path):
    inp, other = tmp_path / "in.jsonl", tmp_path / "other.jsonl"
    inp.write_text(records(4))
    other.write_text(records(5))
    out = tmp_path / "o.jsonl"
    assert run(inp, "-o", out, "--shard", "0/2").exit_code == 0
    assert run(inp, "-o", out, "--shard", "1/3").exit_code == 0
    mixed = merge(f"{out}.part-0-of-2", f"{out}.part-1-of-3")
    assert mixed.exit_code == 5 and "from different shard counts: N = 2, 3" in mixed.stderr
    assert run(inp, "-o", out, "--shard", "1/2").exit_code == 0
    wrong = merge(f"{out}.part-0-of-2", "--input", other)
    assert wrong.exit_code == 5 and "the parts were written for" in wrong.stderr
    # A part edited by hand (an id repeated) is caught while merging; the final file never appears.
    part1 = tmp_path / "o.jsonl.part-1-of-2"
    lines = [json.loads(x) for x in part1.read_text().splitlines()]
    lines[0]["id"] = "r0"
    part1.write_text("".join(json.dumps(x) + "\n" for x in lines))
    dup = merge(f"{out}.part-0-of-2")
    assert dup.exit_code == 5 and "id 'r0' appears twice" in dup.stderr and not out.exists()
    checked = merge(f"{out}.part-0-of-2", "--input", inp)
    assert checked.exit_code == 5 and "record 2 has id 'r0', the input's (line 2) is 'r1'" in checked.stderr
    missing = merge(out, "--input", tmp_path / "nope.jsonl")
    assert missing.exit_code == 3 and "nope.jsonl: no such file" in missing.stderr


def test_shard_to_stdout_and_bad_env_are_usage_errors(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(records(2))
    assert "--shard: a shard writes OUT.part-I-of-N: give -o OUT" in run(inp, "--shard", "0/2").stderr
    bad = run(inp, "-o", tmp_path / "o.jsonl", env={"VBATCH_SHARD": "5/2"})
    assert bad.exit_code == 2 and "error: VBATCH_SHARD: needs 0 <= I < N, got 5/2" in bad.stderr

"""vbatch beside a busy process: the same runs on a quiet machine, then beside a process spinning on one
of its CPUs with the team fixed (`VBATCH_ADAPTIVE_THREADS=0`) and with the team adapting (the default;
engine/cpu_threads.py), alternating, with medians and ratios.

    python bench/contention.py [--num-prompts 32] [--input-len 128-256] [--output-len 64]
                               [--latency-iters 3] [--repeats 2] [--threads N] [--workdir DIR] [--shards]

Each case is two `vbatch bench throughput --json` runs (N prompts, and `--latency` at batch 1); the
busy process is a Python loop pinned to the last CPU of this process's affinity mask, started before
the run and killed after it, at the same priority as vbatch (a user's other job). Prints a markdown
table (output tok/s, the throughput run's prefill and decode phases, batch-1 tok/s, the team the run
reported) and the ratios: adapting / fixed beside the busy process, and adapting beside it / quiet.
--shards runs another case instead: two vbatch processes started at once, each configured with all
the cores (two `vbatch run --shard` jobs), teams fixed and adapting, each process's output tok/s and
the wall time until both are done.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPIN = "while True:\n    pass\n"
CASES = (("quiet", False, "1"), ("busy, team fixed", True, "0"), ("busy, team adapts", True, "1"))


def say(msg: str) -> None:
    print(f"[contention {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def spinner(cpu: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SPIN])
    os.sched_setaffinity(proc.pid, {cpu})
    return proc


def bench_cmd(args) -> list[str]:
    """`vbatch bench throughput` with this run's output length and threads."""
    vbatch = shutil.which("vbatch") or str(Path(sys.executable).parent / "vbatch")
    return [vbatch, "bench", "throughput", "--output-len", str(args.output_len), "--threads", str(args.threads)]


def run_case(args, busy: bool, adaptive: str, out: Path) -> dict:
    common = bench_cmd(args)
    cmds = {"throughput": common + ["--num-prompts", str(args.num_prompts), "--input-len", args.input_len],
            "latency": common + ["--latency", "--input-len", args.input_len.split("-")[0],
                                 "--num-iters", str(args.latency_iters)]}
    env = dict(os.environ, VBATCH_ADAPTIVE_THREADS=adaptive)
    result: dict = {}
    for kind, cmd in cmds.items():
        json_path = out.with_suffix(f".{kind}.json")
        proc = spinner(args.cpu) if busy else None
        try:
            if proc is not None:
                time.sleep(0.5)   # the loop is running before the engine starts
            subprocess.run(cmd + ["--json", str(json_path)], env=env, check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
        result[kind] = json.loads(json_path.read_text())
    t = result["throughput"]["throughput"]
    return {"output_tok_s": t["output_tokens_per_s"], "prefill_s": t.get("prefill_phase_s"),
            "decode_s": t.get("decode_phase_s"),
            "batch1_tok_s": result["latency"]["latency"]["output_tokens_per_s"],
            "team": result["throughput"].get("thread_budget", f"{result['throughput']['threads']} threads"),
            "team_batch1": result["latency"].get("thread_budget", "")}


def run_shards(args, adaptive: str, out: Path) -> dict:
    """Two `vbatch bench throughput` processes started at once, each configured with --threads (as two
    `vbatch run --shard` jobs started with all cores each), different prompts (seeds 0 and 1)."""
    env = dict(os.environ, VBATCH_ADAPTIVE_THREADS=adaptive)
    paths = [out.with_suffix(f".shard{s}.json") for s in (0, 1)]
    cmd = bench_cmd(args) + ["--num-prompts", str(args.num_prompts), "--input-len", args.input_len]
    start = time.monotonic()
    procs = [subprocess.Popen(cmd + ["--seed", str(s), "--json", str(path)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for s, path in enumerate(paths)]
    if any(p.wait() for p in procs):
        sys.exit(f"a shard failed: {[p.returncode for p in procs]}")
    wall = time.monotonic() - start
    reports = [json.loads(path.read_text()) for path in paths]
    return {"wall_s": wall, "output_tok_s": [r["throughput"]["output_tokens_per_s"] for r in reports],
            "elapsed_s": [r["throughput"]["elapsed_s"] for r in reports],
            "team": reports[0].get("thread_budget", f"{reports[0]['threads']} threads")}


def shards_main(args, workdir: Path) -> None:
    """--shards: the team fixed against the team that adapts, with no busy loop: the two processes
    are each other's load."""
    cases = (("two processes, teams fixed", "0"), ("two processes, teams adapt", "1"))
    runs: dict[str, list[dict]] = {name: [] for name, _ in cases}
    for rep in range(args.repeats):
        for name, adaptive in (cases if rep % 2 == 0 else cases[::-1]):
            say(f"repeat {rep}: {name}")
            r = run_shards(args, adaptive, workdir / f"shards-{adaptive}-r{rep}")
            say(f"  {', '.join(f'{v:.1f}' for v in r['output_tok_s'])} output tok/s; both done in {r['wall_s']:.1f} s")
            runs[name].append(r)
    print(f"\nTwo processes at once, each {args.num_prompts} prompts of {args.input_len} tokens x {args.output_len} "
          f"out with {args.threads} threads configured; medians of {args.repeats}\n")
    print("| case | output tok/s of each (median over processes and runs) | generate s | both done in s | team | runs |")
    print("|---|---:|---:|---:|---|---|")
    med = {}
    for name, _ in cases:
        rates = [v for r in runs[name] for v in r["output_tok_s"]]
        med[name] = statistics.median(rates)
        each = "; ".join(", ".join(f"{v:.1f}" for v in r["output_tok_s"]) for r in runs[name])
        print(f"| {name} | {med[name]:.1f} | {statistics.median(v for r in runs[name] for v in r['elapsed_s']):.1f} "
              f"| {statistics.median(r['wall_s'] for r in runs[name]):.1f} | {runs[name][-1]['team']} | {each} |")
    print(f"\noutput tok/s of each process: teams adapting / fixed {med[cases[1][0]] / med[cases[0][0]]:.2f}x")
    print(f"\nworkdir {workdir}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", default="128-256")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--latency-iters", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    cpus = sorted(os.sched_getaffinity(0))
    parser.add_argument("--threads", type=int, default=len(cpus))
    parser.add_argument("--cpu", type=int, default=cpus[-1], help="the CPU the busy process is pinned to")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--shards", action="store_true",
                        help="instead: two vbatch processes at once, each with --threads, teams fixed and adapting")
    args = parser.parse_args()
    if len(cpus) < 2:
        sys.exit("needs two CPUs or more in this process's affinity mask")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="vbatch-contention-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.shards:
        shards_main(args, workdir)
        return
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in CASES}
    for rep in range(args.repeats):
        order = CASES if rep % 2 == 0 else CASES[::-1]
        for name, busy, adaptive in order:
            say(f"repeat {rep}: {name}")
            r = run_case(args, busy, adaptive, workdir / f"{name.replace(', ', '-').replace(' ', '_')}-r{rep}")
            say(f"  {r['output_tok_s']:.1f} output tok/s, batch 1 {r['batch1_tok_s']:.1f}; {r['team']}")
            runs[name].append(r)

    def med(name: str, key: str) -> float:
        values = [r[key] for r in runs[name] if r[key] is not None]
        return statistics.median(values) if values else float("nan")

    print(f"\n{args.num_prompts} prompts of {args.input_len} tokens x {args.output_len} out, and batch 1 "
          f"({args.input_len.split('-')[0]} + {args.output_len}); {args.threads} threads configured; busy process "
          f"on CPU {args.cpu}; medians of {args.repeats}\n")
    print("| case | output tok/s | prefill phase s | decode phase s | batch-1 tok/s | team (throughput run) | runs |")
    print("|---|---:|---:|---:|---:|---|---|")
    for name, _, _ in CASES:
        each = ", ".join(f"{r['output_tok_s']:.1f} / {r['batch1_tok_s']:.1f}" for r in runs[name])
        print(f"| {name} | {med(name, 'output_tok_s'):.1f} | {med(name, 'prefill_s'):.2f} | {med(name, 'decode_s'):.2f} "
              f"| {med(name, 'batch1_tok_s'):.1f} | {runs[name][-1]['team']} | {each} |")
    fixed, adapts, quiet = CASES[1][0], CASES[2][0], CASES[0][0]
    for key, what in (("output_tok_s", "output tok/s"), ("batch1_tok_s", "batch-1 tok/s")):
        print(f"\n{what}: adapting / fixed beside the busy process {med(adapts, key) / med(fixed, key):.2f}x; "
              f"adapting beside it / quiet {med(adapts, key) / med(quiet, key):.2f}x", end="")
    print(f"\n\nworkdir {workdir}")


if __name__ == "__main__":
    main()

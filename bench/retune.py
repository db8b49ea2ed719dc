"""The native kernels' tuned constants raced again on this CPU: each one's alternatives, built from this
tree with -D flags, against the build as it stands, one race per alternative in one process.

    python bench/retune.py [--tier avx2] [--only STREAMS_1 SPAN_PREFETCH ...] [--quick] [--list]

Each constant below was chosen by a race on one CPU kind (`decided` says which; the C source's NOTE
beside the constant and docs/performance/ hold the numbers). A CPU of another kind should run the races
again before a constant is trusted there: this script does that in one command. For every constant that
applies to the tier (default: this CPU's), it builds this tree once per alternative with
VBATCH_NATIVE_CFLAGS="-DNAME=VALUE" (kernels/native_build.py: the flags are part of the build's cache
key, so each lands in its own folder and is reused by the next run), runs the constant's race script
(`bench/small_rows.py` or `bench/decode_attention.py`) with `--against` that build, and reads the
race's verdict: the median of the per-round ratios, as the alternative's speed over the kept build's
(above 1: the alternative is faster), and whether the two builds' outputs differ. Prints a markdown
table; a race that fails is a row saying why, and the script then exits 1.

What the ratios mean: a ratio within about 3% of 1 is this machine's noise (docs/performance/
contention.md); a constant worth changing wins by more than that, again in a second run, and then end
to end (`vbatch bench throughput`, ABBA). The small-rows limit is a Python-level choice raced end to
end by `bench/small_rows_limit.py`, not here. --quick runs fewer rounds (a smoke run, not a verdict).
Run it in its own high-priority session on a shared machine (REFERENCE 8):
    setsid --wait bash -c 'echo -19 > /proc/$$/autogroup; exec nice -n -19 "$@"' _ python bench/retune.py
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Knob:
    """A tuned constant of the C sources (an `#ifndef NAME` default) and the race that chose it."""
    name: str
    tiers: tuple[str, ...]                  # where it applies
    kept: dict[str, str]                    # tier -> the value built in ("*": every tier it applies to)
    alternatives: dict[str, tuple[str, ...]]   # tier ("*": any) -> values to race against the kept one
    script: str                             # bench/<script>
    args: tuple[str, ...]                   # the race's shape (placeholders: shape_args)
    quick: tuple[str, ...]                  # the fewer rounds of --quick
    decided: str                            # where and how the kept value was chosen

    def value(self, table: dict[str, object], tier: str):
        return table.get(tier, table.get("*"))

    def kept_on(self, tier: str, flags: tuple[str, ...]) -> str:
        """The value this CPU's build has: a -DNAME=V among its build flags (a choice for this CPU,
        kernels/native_build.build_flags), else the source's value for the tier."""
        chosen = [flag.split("=", 1)[1] for flag in flags if flag.startswith(f"-D{self.name}=")]
        return chosen[-1] if chosen else self.value(self.kept, tier)

    def raced_on(self, tier: str, flags: tuple[str, ...]) -> tuple[str, ...]:
        """The values raced against the kept one: the tier's alternatives, and the source's own value
        where this CPU builds another."""
        kept = self.kept_on(tier, flags)
        values = (*self.value(self.alternatives, tier), self.value(self.kept, tier))
        return tuple(dict.fromkeys(v for v in values if v != kept))


SMALL_ROWS = ("--rounds", "60")
SMALL_ROWS_QUICK = ("--rounds", "3", "--layers", "2")
ATTENTION = ("--repeats", "15", "--calls", "100")
ATTENTION_QUICK = ("--repeats", "3", "--calls", "2", "--layers", "1")
ALL = ("avx512-bf16", "avx512", "avx2", "portable")
NARROW = ("avx2", "portable")

KNOBS = (
    Knob("STREAMS_1", ALL, {"*": "4"}, {"*": ("8",)},
         "small_rows.py", ("--dtype", "float32", "--weights", "{half}", "--rows", "1"), SMALL_ROWS_QUICK,
         "weight streams a thread at one row of fp32 x: 4 on 16 lanes (Zen 4, session 36), on avx2 (Zen 3, session 40)"),
    Knob("BF16_STREAMS", ("avx512-bf16",), {"*": "4"}, {"*": ("8",)},
         "small_rows.py", ("--dtype", "bfloat16", "--rows", "1"), SMALL_ROWS_QUICK,
         "weight streams a thread at one bf16 row: Intel Xeon (19.5 GB/s at 4, 19.0 at 8)"),
    Knob("VB_F32_PREFETCH_FEW", ALL, {"*": "4096"}, {"*": ("0", "2048")},
         "small_rows.py", ("--dtype", "float32", "--weights", "{half}", "--rows", "4"), SMALL_ROWS_QUICK,
         "bytes prefetched ahead at 3-4 rows of x: Zen 4 (avx2 tier 1.35-1.38x, session 36)"),
    Knob("Q8_PREFETCH_FEW", ("avx512-bf16", "avx512", "avx2"), {"*": "3072"}, {"*": ("0",)},
         "small_rows.py", ("--dtype", "float32", "--weights", "q8_0", "--rows", "4"), SMALL_ROWS_QUICK,
         "bytes prefetched ahead at 3-4 rows over Q8_0 weights: Zen 4 (1.08x, session 36)"),
    Knob("SPAN_PREFETCH", NARROW, {"*": "32"}, {"*": ("16", "64")},
         "decode_attention.py", ("--dtype", "float32", "--kv-dtype", "{half}", "--order", "in-order"), ATTENTION_QUICK,
         "positions prefetched ahead by the decode spans: Intel Xeon (session 12), Zen 4 (session 36); 16 on Zen 3 (session 40)"),
    Knob("SPLIT_BELOW_ROWS", ALL, {"avx512-bf16": "4", "avx512": "4", "*": "2"}, {"*": ("0",)},
         "decode_attention.py", ("--dtype", "{act}", "--kv-dtype", "{kv}", "--batch", "1", "--positions", "1536"),
         ATTENTION_QUICK, "decode rows split along their positions below this many rows: Zen 4 (session 35)"),
    Knob("SPLIT_MIN_POSITIONS", ALL, {"*": "192"}, {"*": ("128", "384")},
         "decode_attention.py", ("--dtype", "{act}", "--kv-dtype", "{kv}", "--batch", "1", "--positions", "1536"),
         ATTENTION_QUICK, "the shortest part of a split row: Zen 4 (session 35)"),
)


def shape_args(args: tuple[str, ...], tier_name: str) -> list[str]:
    """A race's arguments for the tier: {half} its half-precision weight dtype, {act} / {kv} the
    activation and KV-cache dtypes its default model runs in (bf16 on the bf16 tier, else fp32 over
    the half dtype)."""
    from vbatch.kernels import cpu_features
    tier = cpu_features.tier_named(tier_name)
    half = str(tier.half_dtype).removeprefix("torch.")
    act = "bfloat16" if tier.bf16_compute else "float32"
    kv = "bfloat16" if tier.bf16_compute else half
    return [a.replace("{half}", half).replace("{act}", act).replace("{kv}", kv) for a in args]


def race_variant(args: list[str]) -> str:
    """The native kernel variant a race's resolved arguments call (--dtype over --kv-dtype)."""
    import torch

    from vbatch.kernels import native_build

    def dtype_after(flag: str) -> torch.dtype | None:
        return getattr(torch, args[args.index(flag) + 1]) if flag in args else None
    return native_build.entry_suffix(dtype_after("--dtype"), dtype_after("--kv-dtype"))


def build_with(tier_name: str, flags: tuple[str, ...], variant: str) -> Path:
    """This tree's build folder for the tier with `flags` added to the compile (and the cache key),
    `variant`'s library built in it."""
    from vbatch.kernels import cpu_features, native_build
    before = os.environ.get("VBATCH_NATIVE_CFLAGS")
    os.environ["VBATCH_NATIVE_CFLAGS"] = " ".join([*(before or "").split(), *flags])
    try:
        return native_build.build(cpu_features.tier_named(tier_name), (variant,))[0]
    finally:
        if before is None:
            del os.environ["VBATCH_NATIVE_CFLAGS"]
        else:
            os.environ["VBATCH_NATIVE_CFLAGS"] = before


def verdict(script: str, stdout: str, library: Path) -> tuple[float, str]:
    """(the alternative's speed over the kept build's, the outputs' largest difference) from a race's output."""
    if script == "small_rows.py":
        speed = re.search(rf"^  {re.escape(str(library))}: [\d.]+, ([\d.]+)x this build", stdout, re.M)
        differ = re.search(r"^outputs differ by at most (\S+)$", stdout, re.M)
    else:   # decode_attention.py: this build's time over the other's = the other's speed over this one's
        speed = re.search(r"time ratio this / against: median ([\d.]+)", stdout)
        differ = re.search(r"outputs differ by at most (\S+)$", stdout, re.M)
    if speed is None or differ is None:
        raise ValueError(f"bench/{script} printed no verdict:\n{stdout[-1500:]}")
    return float(speed.group(1)), differ.group(1)


def race(knob: Knob, tier: str, value: str, quick: bool, threads: int) -> tuple[float, str, str]:
    """One alternative against the kept build: (speed ratio, outputs' difference, the race's command)."""
    args = shape_args(knob.args, tier)
    library = build_with(tier, (f"-D{knob.name}={value}",), race_variant(args))
    rounds = knob.quick if quick else (SMALL_ROWS if knob.script == "small_rows.py" else ATTENTION)
    command = [sys.executable, str(BENCH / knob.script), *args, *rounds, "--tier", tier, "--threads", str(threads),
               "--against", str(library)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"bench/{knob.script} exited {done.returncode}: {done.stderr.strip()[-1500:]}")
    speed, differ = verdict(knob.script, done.stdout, library)
    shown = " ".join(["python", f"bench/{knob.script}", *args, *rounds, "--tier", tier, "--threads", str(threads),
                      "--against", f"<-D{knob.name}={value}>"])
    return speed, differ, shown


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tier", default=None, help="a native tier this CPU runs (default: its best)")
    ap.add_argument("--only", nargs="+", default=None, metavar="NAME", help="these constants only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="few rounds: a smoke run, not a verdict")
    ap.add_argument("--list", action="store_true", help="print the constants and their races, run nothing")
    args = ap.parse_args()

    from vbatch.kernels import cpu_features, cpu_native
    tier = cpu_features.tier_named(args.tier) if args.tier else cpu_features.selected_tier()
    if not args.list and cpu_native.load(tier) is None:
        raise SystemExit(f"no native {tier.name} kernels here (no C compiler, or VBATCH_CPU_NATIVE=0): nothing to race")
    known = {knob.name for knob in KNOBS}
    unknown = sorted(set(args.only or ()) - known)
    if unknown:
        raise SystemExit(f"no tuned constant named {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    knobs = [k for k in KNOBS if tier.name in k.tiers and (args.only is None or k.name in args.only)]
    if not knobs:
        raise SystemExit(f"none of the constants asked for applies to the {tier.name} tier")
    from vbatch.kernels import native_build
    flags = native_build.build_flags(tier)
    if args.list:
        for k in knobs:
            print(f"{k.name}: kept {k.kept_on(tier.name, flags)}, raced against "
                  f"{', '.join(k.raced_on(tier.name, flags))} by bench/{k.script}; {k.decided}")
        return 0
    features = cpu_features.detect()
    quick = " (--quick: not a verdict)" if args.quick else ""
    print(f"Tier {tier.name} on {features.model_name} ({features.deciding_flags}), {args.threads} threads{quick}.\n")
    print("| constant | kept | alternative | its speed ÷ the kept build's | outputs differ by | race |")
    print("|---|---:|---:|---:|---:|---|")
    failed = 0
    for k in knobs:
        kept = k.kept_on(tier.name, flags)
        for value in k.raced_on(tier.name, flags):
            try:
                speed, differ, shown = race(k, tier.name, value, args.quick, args.threads)
                print(f"| {k.name} | {kept} | {value} | {speed:.3f}x | {differ} | `{shown}` |", flush=True)
            except (RuntimeError, ValueError, subprocess.TimeoutExpired) as err:
                failed += 1
                reason = " ".join(str(err).split())[:300].replace("|", "/")
                print(f"| {k.name} | {kept} | {value} | failed | | {reason} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

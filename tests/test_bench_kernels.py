"""The scripts in bench/ that time the native kernels (small rows, decode attention, the GEMMs, the
small-rows limit, the tuned constants' races), each on a tiny real run: their arithmetic and what they
print. Nothing here asserts a speed."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
CSRC = Path(__file__).resolve().parents[1] / "kernels" / "csrc"

torch.set_num_threads(1)


def test_gemm_backends_script_compares_the_libraries_the_engine_can_use():
    script = BENCH / "gemm_backends.py"
    done = subprocess.run([sys.executable, str(script), "--threads", "1", "--rows", "4", "--passes", "1",
                           "--dtypes", "float32"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(l for l in done.stdout.splitlines() if l.startswith("float32     4 rows"))
    from vbatch.kernels import cpu_native, gemm_libraries
    chosen = gemm_libraries.gemm_backend(torch.float32).name   # this CPU's and tier's: native on avx2
    assert "onednn" in line and "mkl" in line and f"vbatch uses {chosen}" in line and "(1.00" in line
    if cpu_native.load() is not None:  # the peak probe is a native kernel
        peak = next(l for l in done.stdout.splitlines() if l.startswith("fp32 multiply-add peak"))
        assert float(peak.split(": ")[1].split()[0]) > 0 and "of peak" in line


@pytest.mark.parametrize("dtype,weights,plain", [("float32", "float16", False), ("float32", "q8_0", False),
                                                 ("float32", "float16", True)])
def test_small_rows_script_reads_the_model_weights(dtype, weights, plain):
    # fp32 rows (every tier has them) over one layer and the head: the bytes it says it read are the
    # weights' (one layer + head: 3.07 M fp16 weights + 28.3 M head weights; q8_0 17/16 bytes each),
    # from one huge-page arena as the engine's where the OS gives huge pages, unless --plain-pages.

    from vbatch.kernels import cpu_huge_pages
    script = BENCH / "small_rows.py"
    done = subprocess.run([sys.executable, str(script), "--dtype", dtype, "--weights", weights, "--layers", "1",
                           "--threads", "1", "--passes", "2", *(["--plain-pages"] if plain else [])],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    weights_count = 960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536 + 49152 * 576
    mb = weights_count * (2 if weights == "float16" else 17 / 16) / 1e6
    pages = "huge" if cpu_huge_pages.available() and not plain else "4 KiB"
    assert f"5 matrices, {mb:.0f} MB on {pages} pages: best " in done.stdout and " GB/s" in done.stdout, done.stdout


@pytest.mark.parametrize("dtype,kv_dtype", [("float32", "float16"), ("bfloat16", "bfloat16")])
def test_decode_attention_script_times_the_kernel(dtype, kv_dtype):
    # Every tier builds both variants (native_build.VARIANTS), so both run on any CPU.

    script = BENCH / "decode_attention.py"
    done = subprocess.run([sys.executable, str(script), "--batch", "4", "--positions", "300", "--layers", "2",
                           "--threads", "1", "--calls", "3", "--repeats", "1", "--dtype", dtype,
                           "--kv-dtype", kv_dtype], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "4 x 300 positions, 2 layer(s), blocks random, 1 thread(s): " in done.stdout, done.stdout
    assert " GB/s, " in done.stdout and " ns per (position, kv head) and thread" in done.stdout, done.stdout


def _race_against_this_build(script_name: str, *args: str):
    """Run bench/<script_name> with `--against` this build's own folder (so both builds compute
    the same outputs); returns the finished process and the folder."""

    from vbatch.kernels import cpu_features, cpu_native
    native = cpu_native.load(cpu_features.selected_tier())
    if native is None:
        pytest.skip("no native kernels on this machine (no C compiler)")
    script = BENCH / script_name
    done = subprocess.run([sys.executable, str(script), *args, "--against", str(native.folder)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done, native.folder


def test_decode_attention_script_races_another_build():
    # --against: the same entry point of another library, alternating rounds in one process (on the
    # tiled path: --query-rows 8).
    done, _ = _race_against_this_build(
        "decode_attention.py", "--batch", "2", "--positions", "64", "--layers", "1", "--threads", "1", "--calls", "2",
        "--repeats", "3", "--dtype", "float32", "--kv-dtype", "float16", "--query-rows", "8")
    assert "2 x 64 positions (8 query rows each), 1 layer(s)" in done.stdout, done.stdout
    assert "(medians of 3 alternating rounds); time ratio this / against: median " in done.stdout, done.stdout
    assert "outputs differ by at most 0\n" in done.stdout, done.stdout


@pytest.mark.parametrize("kernel", ["fp16", "q8_0", "gated", "gated-q8_0"])
def test_gemm_builds_script_races_the_gemms(kernel):
    # Against this build's own library both sides compute the same outputs; the gated GEMMs equal the
    # plain GEMM followed by the SiLU-and-mul op bit for bit.

    from vbatch.kernels import cpu_features, cpu_native
    native = cpu_native.load(cpu_features.selected_tier())
    if native is None or not native.has_gemm:
        pytest.skip("this tier's native build has no GEMM (cpu_gemm.c needs AVX2 and FMA)")
    script = BENCH / "gemm_builds.py"
    against = [] if kernel.startswith("gated") else ["--against", str(native.folder)]
    done = subprocess.run([sys.executable, str(script), "--kernel", kernel, "--rows", "5,70", "--layers", "2",
                           "--rounds", "2", "--threads", "1", *against], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if " rows: " in line]
    assert len(lines) == 2 and all(line.endswith("outputs identical: True") for line in lines), done.stdout


@pytest.mark.slow
def test_small_rows_limit_script_races_engines_that_differ_in_the_limit():
    # Two engines of the real model in one process, fp32 (the wider case on every fp32 tier); the
    # limits reach the fused decoder layers, and each limit gets its rounds and a token check.

    from vbatch.kernels import cpu_native
    script = BENCH / "small_rows_limit.py"
    done = subprocess.run([sys.executable, str(script), "--limits", "4,8", "--num-prompts", "6", "--rounds", "2",
                           "--input-len", "16-32", "--output-len", "8", "--threads", "1", "--dtype", "float32",
                           "--kv-cache-memory", "64MiB"], capture_output=True, text=True, timeout=600)
    if cpu_native.load() is None:   # no native kernels: the script says there is nothing to race
        assert done.returncode != 0 and "no native small-rows linears" in done.stderr, done.stderr[-2000:]
        return
    assert done.returncode == 0, done.stderr[-2000:]
    for limit in (4, 8):
        said = f"limit {limit}: the fused decoder layers take up to {limit} rows, the multi-step decodes up to {limit}"
        assert said in done.stderr, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 6 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["4", "8"], done.stdout
    assert rows[0].split("|")[5].strip() == "1.000x" and "of 2" in rows[1] and "of 6" in rows[1], done.stdout


def test_small_rows_script_races_another_build():
    # --against: the same entry point of another library, raced in one process beside the read probe.
    done, path = _race_against_this_build("small_rows.py", "--dtype", "float32", "--weights", "float16", "--rows", "3",
                                          "--layers", "1", "--threads", "1", "--rounds", "3")
    assert "3 row(s) of float32 x float16 weights, 1 threads, 3 rounds alternating" in done.stdout, done.stdout
    assert f"  {path}: " in done.stdout and "x this build, " in done.stdout, done.stdout
    assert "  probe 8 streams: " in done.stdout and "outputs differ by at most 0\n" in done.stdout, done.stdout


def _c_defaults(name: str) -> set[str]:
    """The values kernels/csrc gives NAME where nothing overrides it (`#define NAME VALUE` after an
    `#ifndef NAME`), a define naming another constant followed to its number."""
    text = "\n".join(path.read_text() for path in sorted(CSRC.glob("*.[ch]")))
    assert re.search(rf"^#ifndef {name}$", text, re.M), f"{name} is not an overridable constant of kernels/csrc"
    values = set()
    for value in re.findall(rf"^#define {name} (\w+)", text, re.M):
        while not value.isdigit():
            value = re.search(rf"^#define {value} (\w+)", text, re.M).group(1)
        values.add(value)
    return values


def test_retune_lists_the_constants_the_c_sources_build_in():
    # Every tier this CPU runs: each constant's kept value is one the C sources define for it (or the
    # one this CPU's build flags set: SPAN_PREFETCH on Zen 3), and its alternatives are other values
    # (a race of a build against itself would say nothing).
    from vbatch.kernels import cpu_features, native_build
    for tier in cpu_features.detect().tiers:
        chosen = {flag[2:].split("=")[0]: flag.split("=")[1] for flag in native_build.build_flags(tier)
                  if flag.startswith("-D") and "=" in flag}
        done = subprocess.run([sys.executable, str(BENCH / "retune.py"), "--list", "--tier", tier.name],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        listed = re.findall(r"^(\w+): kept (\d+), raced against ([\d, ]+) by bench/(\w+\.py); ", done.stdout, re.M)
        assert len(listed) == len(done.stdout.splitlines()) >= 4, done.stdout
        for name, kept, alternatives, script in listed:
            assert kept == chosen[name] if name in chosen else kept in _c_defaults(name), (tier.name, name, kept)
            assert kept not in alternatives.split(", ") and (BENCH / script).exists(), (tier.name, name)
    unknown = subprocess.run([sys.executable, str(BENCH / "retune.py"), "--only", "NO_SUCH", "--list"],
                             capture_output=True, text=True, timeout=120)
    assert unknown.returncode != 0 and "no tuned constant named NO_SUCH; known: " in unknown.stderr


def test_retune_races_a_constant_against_the_kept_build():
    # STREAMS_1 applies to every tier: one alternative build (compiled here, or reused from the cache),
    # raced by bench/small_rows.py; the streams split the output rows, not a row's sum, so the two
    # builds' outputs are equal.
    from vbatch.kernels import cpu_features, cpu_native
    tier = cpu_features.selected_tier()
    if cpu_native.load(tier) is None:
        pytest.skip("no native kernels on this machine (no C compiler)")
    done = subprocess.run([sys.executable, str(BENCH / "retune.py"), "--only", "STREAMS_1", "--quick",
                           "--threads", "1"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"Tier {tier.name} on " in done.stdout and "(--quick: not a verdict)" in done.stdout, done.stdout
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| STREAMS_1 |")]
    assert len(rows) == 1, done.stdout
    speed, differ, race = rows[0][4].strip(), rows[0][5].strip(), rows[0][6]
    assert re.fullmatch(r"\d+\.\d{3}x", speed) and float(speed[:-1]) > 0, rows[0]
    assert differ == "0" and "python bench/small_rows.py " in race and "--against <-DSTREAMS_1=" in race, rows[0]

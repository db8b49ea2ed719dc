"""The portable tier on aarch64: the native kernels cross-compiled for ARM, run under qemu-user, give
what this x86-64 machine's portable build gives.

The portable tier (kernels/cpu_features.py PORTABLE: plain C the compiler vectorises, 4-lane vectors,
no intrinsics) is what an ARM machine builds. The rest of the suite tests it on x86-64 against the
PyTorch references (forced with VBATCH_CPU_TIER, conftest.native_test_tiers); this file builds the same
sources with the same flags twice, for this machine and with aarch64-linux-gnu-gcc, links each with
tests/csrc/cross_check.c (every kernel on fixed inputs, its results written to a file) and compares
the two files: the x86-64 build is the oracle.

Tolerances, per record, of its largest magnitude: 1e-4 for fp32 results (the aarch64 build contracts
a * b + c into FMAs, SSE2 has none: a last-bit difference per step; measured at most 2e-6, and 2.4e-5
after the FMA probe's 1,000-step chains); one bf16 step (2^-7) for bf16 activations, where a
last-bit difference can move a rounding. Return codes, stored KV-cache codes and sampled token ids match
exactly.

Needs the cross compiler and qemu-user (Debian: `apt-get install gcc-aarch64-linux-gnu
qemu-user-static`; .ci/run installs them); without them the test skips with that reason. On an
aarch64 machine the suite tests the portable tier natively instead.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from vbatch.kernels import cpu_features, native_build

HARNESS = Path(__file__).with_name("csrc") / "cross_check.c"
CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
SYSROOT = Path("/usr/aarch64-linux-gnu")  # Debian's cross libc, libgomp (the loader qemu-user uses)

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or not shutil.which(CROSS_CC) or not QEMU or not shutil.which("cc"),
    reason=f"needs an x86-64 machine with `cc`, {CROSS_CC} and qemu-aarch64 "
           "(apt-get install gcc-aarch64-linux-gnu qemu-user-static)")

# (activations, KV cache) builds checked: an fp32 model's storage on this tier (bf16 weights and KV
# cache), exact fp32, a bf16 model, and an fp8 cache (the KV sources only). The other four variants
# differ from these only in the KV cache's conversions (fp16, E5M2) or pair them with bf16
# activations; each build pair costs ~25 s of the two cores.
VARIANTS = [(key, native_build.VARIANTS[key]) for key in [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float8_e4m3fn)]]
VARIANT_IDS = [suffix for _, (suffix, _) in VARIANTS]


def _build(cc: str, defines: tuple[str, ...], sources: tuple[Path, ...], out: Path) -> tuple[Path, str]:
    """The harness linked with `sources`, built by `cc` with the portable tier's flags: (program, warnings)."""
    out.mkdir(parents=True)
    flags = (*native_build.FLAGS, *cpu_features.PORTABLE.compile_flags, *defines, f"-I{native_build.CSRC}")
    jobs = [[cc, *flags, "-c", str(source), "-o", str(out / f"{source.stem}.o")] for source in sources]
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(lambda job: subprocess.run(job, capture_output=True, text=True), jobs))
    for job, proc in zip(jobs, procs):
        assert proc.returncode == 0, f"{cc} failed on {job[-3]}:\n{proc.stderr[-3000:]}"
    program = out / "cross_check"
    link = subprocess.run([cc, *flags, str(HARNESS), *(str(out / f"{s.stem}.o") for s in sources), "-lm",
                           "-o", str(program)], capture_output=True, text=True)
    assert link.returncode == 0, f"{cc} failed to link the harness:\n{link.stderr[-3000:]}"
    return program, "".join(proc.stderr for proc in procs)


def _records(path: Path) -> dict[str, np.ndarray]:
    data, at, records = path.read_bytes(), 0, {}
    while at < len(data):
        name = data[at:at + 32].rstrip(b"\0").decode()
        count = int(np.frombuffer(data, np.int64, 1, at + 32)[0])
        records[name] = np.frombuffer(data, np.float32, count, at + 40).astype(np.float64)
        at += 40 + 4 * count
    return records


def _exact(name: str) -> bool:
    return name.endswith(" rc") or name.startswith(("write_kv", "sample", "vector lanes"))


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_portable_kernels_on_aarch64_match_this_machines_portable_build(variant, tmp_path):
    (activations, kv_cache), (suffix, defines) = variant
    sources = native_build.KV_SOURCES if kv_cache in native_build.FP8_KV_DTYPES else native_build.SOURCES
    host, host_warnings = _build("cc", defines, sources, tmp_path / "x86_64")
    arm, arm_warnings = _build(CROSS_CC, defines, sources, tmp_path / "aarch64")
    # the build must be clean on both: the kernels' build hides warnings, so they would go unseen
    assert not host_warnings and not arm_warnings, host_warnings + arm_warnings

    assert int.from_bytes(arm.read_bytes()[18:20], "little") == 183  # ELF e_machine: EM_AARCH64
    subprocess.run([str(host), str(tmp_path / "x86_64.bin")], check=True, timeout=120)
    env = {**os.environ, "QEMU_LD_PREFIX": str(SYSROOT)}
    subprocess.run([QEMU, str(arm), str(tmp_path / "aarch64.bin")], check=True, timeout=300, env=env)
    want, got = _records(tmp_path / "x86_64.bin"), _records(tmp_path / "aarch64.bin")

    assert list(got) == list(want)
    assert got["vector lanes"][0] == want["vector lanes"][0] == 4  # SSE2 here, NEON there
    # every kernel ran; with bf16 activations the small-rows linear exists only where the CPU has
    # avx512_bf16, so there (and in the layer that calls it) both builds return 1, "no kernel"
    bf16_only_with_avx512 = ("linear_small", "decoder_layer") if activations == torch.bfloat16 else ()
    codes = {name: v[0] for name, v in want.items() if name.endswith(" rc")}
    assert codes and all(code == (1 if name.startswith(bf16_only_with_avx512) else 0)
                         for name, code in codes.items()), codes
    step = 2.0 ** -7 if activations == torch.bfloat16 else 1e-4
    for name, expected in want.items():
        actual = got[name]
        if _exact(name):
            np.testing.assert_array_equal(actual, expected, err_msg=name)
        else:
            scale = float(np.abs(expected).max()) if expected.size else 0.0
            assert np.isfinite(actual).all(), name
            np.testing.assert_allclose(actual, expected, rtol=0, atol=step * scale + 1e-7, err_msg=name)

"""The portable tier on aarch64: the native kernels cross-compiled for ARM, run under qemu-user, give
what this x86-64 machine's portable build gives.

The portable tier (kernels/cpu_features.py PORTABLE: plain C the compiler vectorises, 4-lane vectors,
no intrinsics) is what an ARM machine builds. The rest of the suite tests it on x86-64 against the
PyTorch references (forced with VBATCH_CPU_TIER, conftest.native_test_tiers). Here
`native_build.build` makes the library twice, as the engine does: for this machine, and with
aarch64-linux-gnu-gcc for an aarch64 CPU (the flags an ARM machine would use, into a scratch cache).
tests/csrc/cross_check.c (every kernel on fixed inputs, its results written to a file) is linked
against each library, once per build variant, and the two files are compared: the x86-64 build is
the oracle.

Tolerances, per record, of its largest magnitude: 1e-4 for fp32 results (the aarch64 build contracts
a * b + c into FMAs, SSE2 has none: a last-bit difference per step; measured at most 2e-6, and 2.4e-5
after the FMA probe's 1,000-step chains); one bf16 step (2^-7) for bf16 activations, where a
last-bit difference can move a rounding. Return codes, stored KV-cache codes and sampled token ids
match exactly. The aarch64 build must also compile without a warning (the build logs them).

Needs the cross compiler and qemu-user (Debian: `apt-get install gcc-aarch64-linux-gnu
qemu-user-static`; .ci/run installs them); without them the test skips with that reason. On an
aarch64 machine the suite tests the portable tier natively instead.
"""
from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from vbatch.kernels import native_build
from vbatch.kernels.cpu_features import PORTABLE, CpuFeatures

HARNESS = Path(__file__).with_name("csrc") / "cross_check.c"
CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
SYSROOT = Path("/usr/aarch64-linux-gnu")  # Debian's cross libc and libgomp (the loader qemu-user uses)
ARM = CpuFeatures(machine="aarch64", model_name="aarch64 (cross-compiled)", flags=frozenset({"fp", "asimd"}))

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or not shutil.which(CROSS_CC) or not QEMU or not shutil.which("cc"),
    reason=f"needs an x86-64 machine with `cc`, {CROSS_CC} and qemu-aarch64 "
           "(apt-get install gcc-aarch64-linux-gnu qemu-user-static)")

VARIANTS = list(native_build.VARIANTS.items())
VARIANT_IDS = [suffix for _, (suffix, _) in VARIANTS]


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    """(this machine's portable build folder, the aarch64 one, what the aarch64 compiles warned of)."""
    host, _ = native_build.build(PORTABLE, native_build.ALL_VARIANTS)
    warnings: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger, level = native_build.logger, native_build.logger.level
    logger.addHandler(handler), logger.setLevel(logging.DEBUG)
    try:
        with pytest.MonkeyPatch.context() as env:  # a scratch cache: always compiled, never the user's
            env.setenv("VBATCH_CACHE", str(tmp_path_factory.mktemp("aarch64-cache")))
            arm, compiled = native_build.build(PORTABLE, native_build.ALL_VARIANTS, compiler=CROSS_CC, cpu=ARM)
    finally:
        logger.removeHandler(handler), logger.setLevel(level)
    assert all(compiled.values())
    return host, arm, warnings


def _program(cc: str, library: Path, defines: tuple[str, ...], cpu: CpuFeatures | None, out: Path) -> Path:
    """tests/csrc/cross_check.c for one variant, linked against `library`."""
    flags = (*native_build.build_flags(PORTABLE, cpu), *defines, f"-I{native_build.CSRC}")
    proc = subprocess.run([cc, *flags, str(HARNESS), str(library), "-lm", f"-Wl,-rpath,{library.parent}",
                           "-o", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stderr.strip(), f"{cc} on the harness:\n{proc.stderr[-3000:]}"
    return out


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
def test_portable_kernels_on_aarch64_match_this_machines_portable_build(variant, libraries, tmp_path):
    (activations, _), (suffix, defines) = variant
    host_build, arm_build, arm_warnings = libraries
    assert not arm_warnings, "\n".join(arm_warnings)
    host = _program("cc", native_build.library_path(host_build, suffix), defines, None, tmp_path / "x86_64")
    arm = _program(CROSS_CC, native_build.library_path(arm_build, suffix), defines, ARM, tmp_path / "aarch64")
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

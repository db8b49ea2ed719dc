"""Shared test set-up: one torch thread (REFERENCE 6), and the real default model resolved once."""
from __future__ import annotations

import faulthandler
import os
import sys

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The engine sets torch's thread count at start (engine/model_runner.py); tests run with one.
os.environ.setdefault("VBATCH_NUM_THREADS", "1")


# A test that runs longer than this is taken as hung: every thread's Python stack is written to stderr
# and the run exits (status 1). The slowest test takes about a minute. NOTE: a C-level watchdog
# (faulthandler), not pytest-timeout: a process stuck in native code holding the GIL (a deadlock in
# free() inside a signal handler, seen once) never lets a Python timer thread run, and CI would
# instead sit until its 90-minute limit with nothing printed.
HANG_SECONDS = float(os.environ.get("VBATCH_TEST_HANG_SECONDS", "900"))
_terminal = []   # a copy of the real stderr, taken while pytest's output capture is suspended


def pytest_configure(config):
    if HANG_SECONDS > 0:
        _terminal.append(os.fdopen(os.dup(sys.__stderr__.fileno()), "w"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _terminal:   # taken only where HANG_SECONDS > 0
        faulthandler.dump_traceback_later(HANG_SECONDS, exit=True, file=_terminal[0])
    try:
        yield
    finally:
        if _terminal:
            faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    try:
        import torch
    except ImportError:       # CLI-only tests must not need torch
        yield
        return
    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def smollm2_path():
    """The default model as an HF folder (downloaded and converted once into the vbatch cache)."""
    from vbatch.engine.models.resolve import resolve_model
    return resolve_model("smollm2-135m-instruct").path


@pytest.fixture(scope="session")
def minilm_path():
    """all-minilm-l6-v2 (sentence-transformers' folder, from its PyPI package) as an HF folder."""
    from vbatch.engine.models.resolve import resolve_model
    return resolve_model("all-minilm-l6-v2").path


def _cpu():
    try:
        from vbatch.kernels import cpu_features
    except ImportError:       # no torch: nothing CPU-specific runs
        return None
    return cpu_features


def native_test_tiers() -> list:
    """The native-kernel builds the kernel tests run: every tier this CPU runs, and on a CPU without
    AVX-512 also the kernels at 16 lanes in plain C (the AVX-512 tier's vector width and code paths,
    minus its intrinsics), so a change tested on an AVX2 machine has run the 16-lane shape too."""
    cpu_features = _cpu()
    if cpu_features is None:
        return []
    import torch
    tiers = list(cpu_features.detect().tiers)
    if not any("avx512f" in tier.required_flags for tier in tiers):
        tiers.append(cpu_features.CpuTier(
            name="lanes16", required_flags=frozenset(), compile_flags=("-DVB_LANES=16",), half_dtype=torch.bfloat16,
            bf16_compute=False, description="test only: 16 lanes in plain C (the AVX-512 tier's shape)"))
    return tiers


NATIVE_TEST_TIERS = native_test_tiers()


@pytest.fixture(params=NATIVE_TEST_TIERS, ids=[t.name for t in NATIVE_TEST_TIERS])
def native(request):
    """The native kernels of one build (native_test_tiers), every variant built in one pool of compiles
    (the tests run them all; one variant at a time took 80 s a tier here instead of 60); skips where
    they cannot be built."""
    from vbatch.kernels import cpu_native, native_build
    kernels = cpu_native.load(request.param, native_build.ALL_VARIANTS)
    if kernels is None:
        pytest.skip(f"the {request.param.name} native kernels were not built (no C compiler, or VBATCH_CPU_NATIVE=0)")
    return kernels


# The native kernels' activation dtypes and (activation, KV cache) variants (native_params.py; none
# without torch, where nothing CPU-specific runs)
try:
    from native_params import DTYPES, FP8_VARIANT_IDS, FP8_VARIANTS, VARIANT_IDS, VARIANTS
except ImportError:
    DTYPES, VARIANTS, VARIANT_IDS, FP8_VARIANTS, FP8_VARIANT_IDS = [], [], [], [], []


@pytest.fixture(params=DTYPES, ids=["fp32", "bf16"][:len(DTYPES)])
def dtype(request):
    """An activation dtype of the native kernels: fp32, bf16."""
    return request.param


@pytest.fixture(params=VARIANTS, ids=VARIANT_IDS)
def variant(request):
    """(activation dtype, KV-cache dtype): the builds' variants but fp8 (native_build.VARIANTS)."""
    return request.param


@pytest.fixture(params=VARIANTS + FP8_VARIANTS, ids=VARIANT_IDS + FP8_VARIANT_IDS)
def any_variant(request):
    """`variant` and the fp8 caches: for the tests that cover every path of the attention and the KV write."""
    return request.param


def pytest_report_header(config):
    """Which CPU this is and which native-kernel tiers the suite builds and tests on it."""
    cpu_features = _cpu()
    if cpu_features is None:
        return []
    cpu = cpu_features.detect()
    return [f"CPU: {cpu.model_name} ({cpu.machine}; {cpu.deciding_flags})",
            f"native-kernel builds tested: {', '.join(t.name for t in NATIVE_TEST_TIERS)}; "
            f"engine tests run on: {cpu_features.selected_tier().name}"]


def tier_of_test(nodeid: str, names) -> str | None:
    """The tier among `names` that a parametrised test's id names as one of its '-'-separated
    parameters ('test_x[avx512-bf16-float32]' -> 'avx512-bf16', not 'avx512'), else None."""
    if not nodeid.endswith("]") or "[" not in nodeid:
        return None
    params = "-" + nodeid[nodeid.index("[") + 1:-1] + "-"
    for name in sorted(names, key=len, reverse=True):  # the longest first: avx512-bf16 before avx512
        if f"-{name}-" in params:
            return name
    return None


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The CPU paths the run exercised: passed tests per native-kernel tier."""
    cpu_features = _cpu()
    if cpu_features is None:
        return
    passed = [r.nodeid for r in terminalreporter.stats.get("passed", [])]
    counts = {tier.name: 0 for tier in NATIVE_TEST_TIERS}
    for nodeid in passed:
        tier = tier_of_test(nodeid, counts)
        if tier:
            counts[tier] += 1
    counts = [f"{name} {n}" for name, n in counts.items()]
    terminalreporter.write_line(f"CPU paths exercised (tier-parametrised tests passed): {', '.join(counts)}; "
                                f"engine tests on {cpu_features.selected_tier().name}")

"""vbatch's OpenMP wait default (kernels/openmp_env.py), checked against the runtime's own report:
libgomp prints the settings it read at start-up when OMP_DISPLAY_ENV=verbose."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from vbatch.kernels import openmp_env


def _runtime_spin_count(code: str, **extra: str) -> tuple[str, str]:
    """(the spin count libgomp read, the child's stdout) for `python -c code` in a clean environment
    (the avx2 tier unless `extra` says otherwise)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(OMP_DISPLAY_ENV="verbose", VBATCH_CPU_TIER="avx2")
    env.update(extra)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", done.stderr + done.stdout)
    if found is None:
        pytest.skip("torch's OpenMP runtime here is not libgomp (no GOMP_SPINCOUNT in its report)")
    return found.group(1), done.stdout.strip()


def test_importing_vbatch_first_gives_libgomp_the_short_spin_on_the_fp32_tiers():
    for tier in ("avx2", "portable"):   # forced (every x86-64 CPU here runs them), as on a CPU without avx512_bf16
        spins, described = _runtime_spin_count(
            "import vbatch, torch; torch.ones(1); from vbatch.kernels import openmp_env; print(openmp_env.describe())",
            VBATCH_CPU_TIER=tier)
        assert spins == openmp_env.DEFAULT_SPIN_COUNT == "30000"
        assert described == "GOMP_SPINCOUNT=30000 (vbatch's default)"


def test_the_bf16_tier_keeps_libgomps_default():
    spins, described = _runtime_spin_count(
        "import vbatch, torch; torch.ones(1); from vbatch.kernels import openmp_env; print(openmp_env.describe())",
        VBATCH_CPU_TIER="avx512-bf16")
    assert (spins, described) == ("300000", "the OpenMP runtime's default wait")


def test_the_choice_follows_the_cpu_flags(monkeypatch):
    # without a forced tier: the CPU's own flags decide (this machine's CPU is either kind)
    monkeypatch.delenv("VBATCH_CPU_TIER", raising=False)
    for flags, fp32 in ((frozenset({"avx2", "fma", "f16c"}), True), (frozenset({"avx512f", "avx512_bf16"}), False),
                        (frozenset(), True)):
        monkeypatch.setattr(openmp_env, "read_cpuinfo", lambda flags=flags: ("m", "v", flags))
        assert openmp_env._fp32_tier() is fp32


def test_the_users_setting_wins():
    spins, described = _runtime_spin_count(
        "import vbatch, torch; torch.ones(1); from vbatch.kernels import openmp_env; print(openmp_env.describe())",
        GOMP_SPINCOUNT="777")
    assert (spins, described) == ("777", "GOMP_SPINCOUNT=777")
    # a wait policy of the user's: no spin count is added (libgomp derives its own from the policy)
    spins, described = _runtime_spin_count(
        "import vbatch, torch; torch.ones(1); from vbatch.kernels import openmp_env; print(openmp_env.describe())",
        OMP_WAIT_POLICY="active")
    assert spins != openmp_env.DEFAULT_SPIN_COUNT and described == "OMP_WAIT_POLICY=active"


def test_after_torch_it_is_too_late_and_says_so():
    spins, described = _runtime_spin_count(
        "import torch, vbatch; torch.ones(1); from vbatch.kernels import openmp_env; print(openmp_env.describe())")
    assert spins == "300000"  # libgomp's own default: it had read its environment already
    assert described == "the OpenMP runtime's default wait"


def test_peers_get_the_environment_without_vbatchs_default(monkeypatch):
    monkeypatch.setattr(openmp_env, "_applied", "30000")
    assert openmp_env.without_defaults({"GOMP_SPINCOUNT": "30000", "PATH": "/bin"}) == {"PATH": "/bin"}
    assert openmp_env.without_defaults({"GOMP_SPINCOUNT": "5"}) == {"GOMP_SPINCOUNT": "5"}  # the user's own
    monkeypatch.setattr(openmp_env, "_applied", None)   # vbatch set nothing: nothing is removed
    assert openmp_env.without_defaults({"GOMP_SPINCOUNT": "30000"}) == {"GOMP_SPINCOUNT": "30000"}

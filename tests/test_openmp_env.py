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
    """(the spin count libgomp read, the child's stdout) for `python -c code` in a clean environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(OMP_DISPLAY_ENV="verbose", **extra)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", done.stderr + done.stdout)
    if found is None:
        pytest.skip("torch's OpenMP runtime here is not libgomp (no GOMP_SPINCOUNT in its report)")
    return found.group(1), done.stdout.strip()


def test_importing_vbatch_first_gives_libgomp_the_short_spin():
    spins, described = _runtime_spin_count(
        "import vbatch, torch; torch.ones(1); from vbatch.kernels import openmp_env; print(openmp_env.describe())")
    assert spins == openmp_env.DEFAULT_SPIN_COUNT == "10000"
    assert described == "GOMP_SPINCOUNT=10000 (vbatch's default)"


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
    monkeypatch.setattr(openmp_env, "_applied", "10000")
    assert "GOMP_SPINCOUNT" not in openmp_env.without_defaults({"GOMP_SPINCOUNT": "10000", "PATH": "/bin"})
    assert openmp_env.without_defaults({"GOMP_SPINCOUNT": "5"}) == {"GOMP_SPINCOUNT": "5"}  # the user's own
    monkeypatch.setattr(openmp_env, "_applied", None)   # vbatch set nothing: nothing is removed
    assert openmp_env.without_defaults({"GOMP_SPINCOUNT": "10000"}) == {"GOMP_SPINCOUNT": "10000"}

"""engine/cpu_threads.py: the team of CPU threads, fewer while other processes keep our cores busy.

The readings against hand-written /proc/stat texts (hand-computed sums), the rounding with its two
edges, the budget over a scripted sequence of readings, and then for real: a busy-looping process
pinned to one of our CPUs is read as one core of others' load while this process's own busy loop is
not, and an engine computing beside it drops to one thread and back, with the same greedy tokens.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from vbatch.engine.cpu_threads import (ADAPTIVE_ENV, CpuTimes, ThreadBudget, allowed_cpus, cores_to_give_up,
                                       cpu_thread_count, others_busy, read_cpu_times)

# user nice system idle iowait irq softirq steal guest guest_nice
STAT = """cpu  900 10 300 5000 40 5 6 70 0 0
cpu0 100 1 50 1000 10 1 2 30 0 0
cpu1 200 2 60 2000 20 3 4 40 0 0
cpu3 600 7 190 2000 10 1 0 0 0 0
intr 12345 0 0
ctxt 999
btime 1700000000
"""


def test_read_cpu_times_sums_the_masks_cpus_only():
    t = read_cpu_times(frozenset({0, 1}), stat_text=STAT, own_seconds=1.5, ticks_per_second=100)
    # cpu0: 100+1+50+1+2 busy; 100+1+50+1000+10+1+2+30 total. cpu1: 200+2+60+3+4; 200+2+60+2000+20+3+4+40.
    assert t == CpuTimes(total=1194 + 2329, busy=154 + 269, own=150.0, cpus=2)
    assert read_cpu_times(frozenset({3}), stat_text=STAT, own_seconds=0.0, ticks_per_second=100).busy == 798
    with pytest.raises(ValueError, match="none of the CPUs"):
        read_cpu_times(frozenset({7}), stat_text=STAT, own_seconds=0.0, ticks_per_second=100)


def test_others_busy_is_busy_time_less_our_own_over_the_elapsed_ticks():
    before = CpuTimes(total=1000, busy=300, own=100.0, cpus=2)
    # 200 ticks on 2 CPUs = 100 ticks of wall time each; 170 busy ticks, 60 of them ours: 1.1 cores.
    assert others_busy(before, CpuTimes(total=1200, busy=470, own=160.0, cpus=2)) == pytest.approx(1.1)
    # Ours exceeding the busy count (tick rounding) is no load, and no time passing is none either.
    assert others_busy(before, CpuTimes(total=1200, busy=320, own=130.0, cpus=2)) == 0.0
    assert others_busy(before, before) == 0.0


@pytest.mark.parametrize("others, taken_now, taken", [
    (0.0, 0, 0), (0.59, 0, 0), (0.6, 0, 1), (1.0, 0, 1), (1.55, 0, 1), (1.6, 0, 2),
    # a core taken stays taken until others' part of it falls below 0.4
    (0.45, 1, 1), (0.41, 1, 1), (0.39, 1, 0), (1.45, 2, 2), (1.3, 2, 1), (0.2, 2, 0),
])
def test_cores_to_give_up_takes_from_0_6_and_gives_back_below_0_4(others, taken_now, taken):
    assert cores_to_give_up(others, taken_now) == taken


class Script:
    """Readings whose others' load is scripted, a clock moved by hand, and the counts set."""

    def __init__(self, cpus: int = 2):
        self.cpus, self.now, self.reads, self.set = cpus, 0.0, 0, []
        self.t = CpuTimes(total=0, busy=0, own=0.0, cpus=cpus)

    def load(self, others: float, seconds: float = 1.0) -> None:
        """`others` cores busy for `seconds` (100 ticks a second per CPU), and our team fully busy."""
        ticks = 100 * seconds
        own = ticks * min(self.cpus - others, self.cpus)
        self.t = CpuTimes(total=self.t.total + int(ticks * self.cpus), busy=self.t.busy + int(ticks * others + own),
                          own=self.t.own + own, cpus=self.cpus)
        self.now += seconds

    def read(self) -> CpuTimes:
        self.reads += 1
        return self.t

    def budget(self, configured: int, **kw) -> ThreadBudget:
        return ThreadBudget(configured, self.set.append, read=self.read, clock=lambda: self.now, enabled=True, **kw)


def test_budget_drops_a_thread_for_a_busy_core_and_takes_it_back():
    s = Script()
    b = s.budget(2)
    assert s.set == [2] and b.threads == 2
    s.load(0.05)
    assert b.before_step() == 2
    s.load(1.0)
    assert b.before_step() == 1 and s.set == [2, 1]
    s.load(0.45)       # between the edges: stays
    assert b.before_step() == 1
    reads = s.reads
    s.now += 0.1       # within the interval: no reading at all
    assert b.before_step() == 1 and s.reads == reads
    s.load(0.2)
    assert b.before_step() == 2 and s.set == [2, 1, 2]
    assert b.least == 1 and [c[1] for c in b.changes] == [1, 2]
    assert b.describe() == "2 threads, 1 at the least (2 changes for other processes' load)"


def test_budget_counts_only_the_cores_left_free_and_keeps_one_thread():
    s = Script(cpus=8)
    b = s.budget(2)         # 2 threads asked on 8 CPUs: 5 busy elsewhere still leave 3 free
    s.load(5.0)
    assert b.before_step() == 2
    s.load(6.7)
    assert b.before_step() == 1
    s = Script(cpus=2)
    b = s.budget(2)
    s.load(2.0)             # every core busy: one thread still runs
    assert b.before_step() == 1


def test_budget_fixed_when_switched_off_or_single(monkeypatch):
    s = Script()
    monkeypatch.setenv(ADAPTIVE_ENV, "0")
    b = ThreadBudget(2, s.set.append, read=s.read, clock=lambda: s.now)
    s.load(2.0)
    assert b.before_step() == 2 and s.reads == 0 and b.describe() == "2 threads"
    b = s.budget(1)
    s.load(2.0)
    assert b.before_step() == 1 and s.reads == 0


def test_budget_stays_fixed_where_cpu_times_cannot_be_read():
    def unreadable():
        raise OSError("no /proc/stat")
    b = ThreadBudget(2, lambda n: None, read=unreadable, enabled=True)
    assert not b.enabled and b.before_step() == 2


def test_cpu_thread_count_request_env_then_affinity(monkeypatch):
    monkeypatch.setenv("VBATCH_NUM_THREADS", "3")
    assert cpu_thread_count(5) == 5 and cpu_thread_count(None) == 3
    monkeypatch.delenv("VBATCH_NUM_THREADS")
    assert cpu_thread_count(None) == len(os.sched_getaffinity(0))


# ---------------------------------------------------------------------------------- for real

SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\n"


def _spinner(cpu: int, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SPIN.format(s=seconds)])
    os.sched_setaffinity(proc.pid, {cpu})
    return proc


def _two_cpus() -> list[int]:
    cpus = sorted(allowed_cpus())
    if len(cpus) < 2 or not os.path.exists("/proc/stat"):
        pytest.skip("needs two CPUs in this process's affinity mask and /proc/stat")
    return cpus


def test_a_busy_process_reads_as_one_core_and_our_own_loop_as_none():
    cpus = _two_cpus()
    mask = frozenset(cpus[:2])
    spinner = _spinner(cpus[1], 3.0)
    try:
        time.sleep(0.3)   # the interpreter started
        before = read_cpu_times(mask)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:   # this process busy too, on the other CPU
            pass
        others = others_busy(before, read_cpu_times(mask))
    finally:
        spinner.kill()
        spinner.wait()
    # One core of the spinner, give or take the machine's own noise; ours (~1 core) not in it.
    assert 0.75 <= others <= 1.45, others


def test_a_child_this_process_waited_for_reads_as_its_own():
    # The engine's start-up compiles the native kernels in child processes (cc) on every core, then
    # takes its first reading: the compiles are its own work, not another process's load that the
    # first steps should give a core up to (they did, until the next reading).
    cpus = _two_cpus()
    mask = frozenset(cpus[:2])
    before = read_cpu_times(mask)
    spinner = _spinner(cpus[1], 1.0)
    spinner.wait()
    others = others_busy(before, read_cpu_times(mask))
    assert others < 0.5, others   # the child's second of one core counted as ours (a whole core if not)


def test_engine_gives_a_busy_core_up_and_keeps_its_tokens(monkeypatch, smollm2_path):
    """A 2-thread engine beside a process spinning on one of its CPUs runs with one thread (the
    budget's own record), and greedy tokens stay those of a quiet run; the core comes back after."""
    import torch

    from vbatch import LLM, SamplingParams

    cpus = _two_cpus()
    monkeypatch.delenv(ADAPTIVE_ENV, raising=False)
    mask = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, set(cpus[:2]))
        llm = LLM(str(smollm2_path), device="cpu", quiet=True, max_model_len=256, num_threads=2)
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        prompts = ["The capital of France is", "List three colours:"]
        quiet = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        budget = llm.engine.runner.threads
        assert budget.enabled and budget.configured == 2
        spinner = _spinner(cpus[1], 60.0)
        try:
            time.sleep(0.6)
            busy = []
            for _ in range(8):
                busy.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
                if budget.threads == 1:
                    break
            # one whole run on the one thread (the switch above may have come late in its run)
            busy.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
            assert budget.threads == 1, budget.changes
        finally:
            spinner.kill()
            spinner.wait()
        assert budget.least == 1, budget.changes
        assert all(tokens == quiet for tokens in busy)
        for _ in range(8):   # the core comes back once the spinner stopped
            time.sleep(0.3)
            llm.generate(prompts, params)
            if budget.threads == 2:
                break
        assert budget.threads == 2, budget.changes
    finally:
        os.sched_setaffinity(0, mask)
        torch.set_num_threads(1)   # the suite's count (conftest)

"""How many threads the CPU runners compute with: the configured count, less the cores other processes
keep busy on the CPUs this process may use, re-decided between steps.

    cpu_thread_count(requested) -> int     the configured count (request, $VBATCH_NUM_THREADS, affinity)
    ThreadBudget(configured)                .before_step() sets torch's thread count for the next step
    CpuTimes / read_cpu_times / others_busy  the measurement (/proc/stat and this process's CPU time)

NOTE: why (docs/performance/contention.md). Every kernel splits its work over a team of OpenMP threads,
one per core, that meet at a barrier hundreds of times per step and spin while they wait. When another
process keeps one of those cores busy, the team thread there gets half of it, and the rest of the team
spins at every barrier until the kernel scheduler gives it its turn: on a 2-core Zen 4, one busy-looping
process made batch-1 decode 3.6x slower on the avx512-bf16 tier and 8.6x on the avx2 tier, while one
thread on the free core lost little against two on a quiet machine. So before a step, when at least
`interval_s` has passed since the last reading, the runner compares the CPU time spent on its CPUs with
its own: what is left is other processes', in cores (busy time only: user, nice, system, irq, softirq;
a VM's steal time is not taken for a process that a smaller team would avoid). It then computes with
at most the cores those processes leave free, rounded (a core counts as theirs from 0.6 of it, and
as free again below 0.4 of it, so a load near the edge does not flip the team every reading), never
fewer than one thread nor more than the configured count or the CPUs in the mask.
`VBATCH_ADAPTIVE_THREADS=0` keeps the configured count whatever the load (a benchmark that wants a
fixed team). A reading (/proc/stat and os.times) costs ~0.1 ms on a loaded 2-CPU VM, every 0.5 s at most.
Another vbatch process is another process: two shards started with all cores each settle at half each.
The kernels split work, not sums, between threads where it was measured: the avx2 tier's greedy tokens
and logprobs were bitwise the same with 1 and 2 threads (1, 2 and 5 prompts x 64 tokens: attention
then splits its items by heads at one count and not the other; where it splits a row's sum over its
positions, at batch 1-3, the parts follow the call's shape, never the team), so a run whose team
changes gives a quiet run's tokens (tests/test_cpu_threads.py checks it beside a busy process, on
every CPU kind).
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

logger = logging.getLogger("vbatch.engine")

ADAPTIVE_ENV = "VBATCH_ADAPTIVE_THREADS"
TAKE_FROM = 0.6      # others' use of a core from which the team gives that core up
GIVE_BACK_BELOW = 0.4  # ... and below which it takes it back


def cpu_thread_count(requested: int | None) -> int:
    """Threads for torch on CPU: the request, else $VBATCH_NUM_THREADS, else the cores we may use.

    Set explicitly because torch's default follows the machine, not this process's affinity
    mask, and oversubscribed GEMM threads on a shared machine are erratic (REFERENCE 8)."""
    if requested is not None:
        return requested
    env = os.environ.get("VBATCH_NUM_THREADS")
    if env and env.isdigit() and int(env) >= 1:
        return int(env)
    return len(allowed_cpus()) or max(1, os.cpu_count() or 1)


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity mask); empty where the OS does not say."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset()


@dataclass(frozen=True)
class CpuTimes:
    """One reading, in clock ticks since boot, summed over the CPUs this process may use."""
    total: int       # every state (idle and iowait too)
    busy: int        # user + nice + system + irq + softirq (guest is inside user)
    own: float       # this process's user + system time (all its threads, and its children once waited
                     # for), in the same ticks
    cpus: int        # how many CPUs the sums are over


def read_cpu_times(cpus: frozenset[int], stat_text: str | None = None, own_seconds: float | None = None,
                   ticks_per_second: int | None = None) -> CpuTimes:
    """Sum /proc/stat's per-CPU lines over `cpus` (`stat_text`: the file's text, read when None) and
    take this process's CPU time, its waited-for children's included (`own_seconds`: os.times() when None).
    Raises OSError where there is no
    /proc/stat, ValueError where it lists none of `cpus`."""
    text = Path("/proc/stat").read_text() if stat_text is None else stat_text
    hz = ticks_per_second or os.sysconf("SC_CLK_TCK")
    if own_seconds is None:   # the children this process waited for (the kernels' compiles) are its own work
        t = os.times()
        own_seconds = t.user + t.system + t.children_user + t.children_system
    total = busy = found = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(v) for v in rest.split()]
        user, nice, system, idle, iowait, irq, softirq = (ticks + [0] * 7)[:7]
        total += sum(ticks[:8])   # user .. steal (guest and guest_nice are inside user and nice)
        busy += user + nice + system + irq + softirq
        found += 1
    if not found:
        raise ValueError(f"/proc/stat lists none of the CPUs {sorted(cpus)[:8]}")
    return CpuTimes(total=total, busy=busy, own=own_seconds * hz, cpus=found)


def others_busy(before: CpuTimes, after: CpuTimes) -> float:
    """Cores that other processes kept busy between two readings: busy ticks less our own, over the
    ticks each CPU counted (0 when no tick passed)."""
    elapsed_per_cpu = (after.total - before.total) / max(1, after.cpus)
    if elapsed_per_cpu <= 0:
        return 0.0
    others = (after.busy - before.busy) - (after.own - before.own)
    return max(0.0, others / elapsed_per_cpu)


def cores_to_give_up(others: float, given_up: int) -> int:
    """Cores to leave to other processes that keep `others` cores busy, `given_up` being left now:
    each whole core, and a part from TAKE_FROM of it; one already left stays left until its part falls
    below GIVE_BACK_BELOW."""
    take = math.floor(others + 1 - TAKE_FROM)
    if take >= given_up:
        return take
    return max(take, math.floor(others + 1 - GIVE_BACK_BELOW))


def adaptive_enabled() -> bool:
    return os.environ.get(ADAPTIVE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class ThreadBudget:
    """The CPU team's size, step by step (the module docstring says why and how).

    `set_threads` (torch.set_num_threads) is called with the configured count at once, then on every
    change; `read` (read_cpu_times over the affinity mask) and `clock` are replaceable for tests."""

    def __init__(self, configured: int, set_threads: Callable[[int], None], *, interval_s: float = 0.5,
                 enabled: bool | None = None, read: Callable[[], CpuTimes] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.configured = max(1, configured)
        self.threads = self.configured
        self.interval_s = interval_s
        self._set = set_threads
        self._clock = clock
        self._read = read or (lambda cpus=allowed_cpus(): read_cpu_times(cpus))
        self.changes: list[tuple[float, int, float]] = []   # (clock, threads, others' cores) at each change
        self.least = self.configured                          # the fewest threads any step ran with
        set_threads(self.configured)
        self._last: CpuTimes | None = None
        self._taken = 0                                       # cores taken as others' (cores_to_give_up)
        self._last_at = clock()
        self.enabled = (adaptive_enabled() if enabled is None else enabled) and self.configured > 1
        if self.enabled:
            try:
                self._last = self._read()
            except (OSError, ValueError) as e:   # no /proc (another OS), or an odd one: keep the count
                logger.info("thread count stays %d: cannot read CPU times (%s)", self.configured, e)
                self.enabled = False

    def before_step(self) -> int:
        """Re-decide the team when a reading is due; return the threads the step will use."""
        if not self.enabled:
            return self.threads
        now = self._clock()
        if now - self._last_at < self.interval_s:
            return self.threads
        reading = self._read()
        others = others_busy(self._last, reading)
        self._last, self._last_at = reading, now
        self._taken = cores_to_give_up(others, self._taken)
        threads = max(1, min(self.configured, reading.cpus - self._taken))
        if threads != self.threads:
            logger.info("%d threads instead of %d: other processes keep %.1f of this process's %d CPUs busy",
                        threads, self.threads, others, reading.cpus)
            self.threads = threads
            self.least = min(self.least, threads)
            self.changes.append((now, threads, others))
            self._set(threads)
        return threads

    def describe(self) -> str:
        """E.g. "2 threads (fewer while other processes load these CPUs: none did)", or
        "2 threads, 1 at the least (1 change for other processes' load)"."""
        team = f"{self.configured} thread{'s' if self.configured > 1 else ''}"
        if not self.enabled:
            return team
        if not self.changes:
            return f"{team} (fewer while other processes load these CPUs: none did)"
        n = len(self.changes)
        return f"{team}, {self.least} at the least ({n} change{'s' if n > 1 else ''} for other processes' load)"

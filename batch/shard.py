"""Shards for job arrays: which records one task of N processes, and where its part goes.

A shard `I/N` takes the records whose 0-based position in the input satisfies `position % N == I`,
so every task streams the same file and no index is needed. Its output is `OUT.part-I-of-N`
(resumable like any output); `vbatch merge` interleaves the parts back into input order.
The shard comes from `--shard I/N`, else `VBATCH_SHARD=I/N`, else a Slurm array
(`SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN` over `SLURM_ARRAY_TASK_STEP`, of
`SLURM_ARRAY_TASK_COUNT`). Called by `vbatch run` and `vbatch.batch.merge`.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from ..engine.errors import ConfigError

T = TypeVar("T")
_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")
_PART = re.compile(r"^(?P<base>.+)\.part-(?P<index>\d+)-of-(?P<count>\d+)$")


@dataclass(frozen=True)
class Shard:
    index: int   # 0-based
    count: int   # N >= 1; 1 means "the whole input"
    source: str  # where it came from, for messages: "--shard", "VBATCH_SHARD", "SLURM_ARRAY_*"

    @property
    def is_whole(self) -> bool:
        return self.count == 1

    def spec(self) -> str:
        return f"{self.index}/{self.count}"

    def owns(self, position: int) -> bool:
        return position % self.count == self.index

    def select(self, items: Iterable[T]) -> Iterator[T]:
        """The items at this shard's positions, lazily (a stream in, a stream out)."""
        for position, item in enumerate(items):
            if position % self.count == self.index:
                yield item


WHOLE = Shard(0, 1, "default")


def parse_shard(spec: str, source: str = "--shard") -> Shard:
    m = _SPEC.match(spec)
    if m is None:
        raise ConfigError(source, f"expected I/N (e.g. 0/4), got {spec!r}")
    index, count = int(m.group(1)), int(m.group(2))
    if count < 1 or not 0 <= index < count:
        raise ConfigError(source, f"needs 0 <= I < N, got {index}/{count}",
                          hint="shards are numbered from 0: the last of 4 is 3/4")
    return Shard(index, count, source)


def shard_from_env(env: Mapping[str, str]) -> Shard | None:
    """VBATCH_SHARD, else the Slurm array variables; None when neither is set."""
    if env.get("VBATCH_SHARD"):
        return parse_shard(env["VBATCH_SHARD"], "VBATCH_SHARD")
    task_id, count = env.get("SLURM_ARRAY_TASK_ID"), env.get("SLURM_ARRAY_TASK_COUNT")
    if not task_id or not count:
        return None
    try:
        first = int(env.get("SLURM_ARRAY_TASK_MIN") or 0)
        step = int(env.get("SLURM_ARRAY_TASK_STEP") or 1)
        offset, n = int(task_id) - first, int(count)
    except ValueError:
        raise ConfigError("SLURM_ARRAY_TASK_ID", f"not integers: id={task_id!r} count={count!r}") from None
    if step < 1 or offset % step:
        raise ConfigError("SLURM_ARRAY_TASK_STEP", f"task {task_id} is not on the array's step {step}")
    return parse_shard(f"{offset // step}/{n}", "SLURM_ARRAY_TASK_ID")


def resolve_shard(flag: str | None, env: Mapping[str, str] | None = None) -> Shard:
    """Precedence: `--shard` > VBATCH_SHARD > Slurm array > the whole input."""
    if flag:
        return parse_shard(flag)
    found = shard_from_env(os.environ if env is None else env)
    return found if found is not None else WHOLE


def part_path(output: str, shard: Shard) -> str:
    """Where this shard writes: OUT itself for the whole input, else `OUT.part-I-of-N`."""
    return output if shard.is_whole else f"{output}.part-{shard.index}-of-{shard.count}"


def split_part_path(path: str) -> tuple[str, int, int] | None:
    """`OUT.part-I-of-N` -> (OUT, I, N); None for any other name."""
    m = _PART.match(path)
    if m is None:
        return None
    return m.group("base"), int(m.group("index")), int(m.group("count"))

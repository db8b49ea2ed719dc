"""Whole-file validation without the model: what `vbatch validate` (and `vbatch run --strict`) runs.

Streams the reader once, hands each RecordError to a callback (so a million bad lines are
printed, not stored) and returns the counts.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .readers import RecordReader
from .record import RecordError


@dataclass(frozen=True)
class ValidationSummary:
    file: str
    format: str
    num_records: int
    num_ok: int
    num_problems: int
    by_kind: dict[str, int]

    @property
    def is_clean(self) -> bool:
        return self.num_problems == 0


def validate_reader(reader: RecordReader, on_problem: Callable[[RecordError], None]) -> ValidationSummary:
    num_records = num_problems = 0
    by_kind: dict[str, int] = {}
    for rec in reader:
        num_records += 1
        if isinstance(rec, RecordError):
            num_problems += 1
            on_problem(rec)
        else:
            by_kind[rec.kind] = by_kind.get(rec.kind, 0) + 1
    return ValidationSummary(file=reader.name, format=reader.format, num_records=num_records,
                             num_ok=num_records - num_problems, num_problems=num_problems, by_kind=by_kind)

"""Typed errors: everything a user can cause raises a VBatchError subclass.

The CLI maps each class to an exit code and a one-line hint; library callers can
catch the class they care about. `assert` stays for internal invariants only.
"""
from __future__ import annotations


class VBatchError(Exception):
    """Base of every error a user can cause. `hint` is one line telling what to do."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class ConfigError(VBatchError, ValueError):
    """A bad engine/CLI option or argument. Names the field and the allowed range."""

    exit_code = 2

    def __init__(self, field: str, message: str, *, hint: str | None = None) -> None:
        super().__init__(f"{field}: {message}", hint=hint)
        self.field = field


class SamplingParamsError(ConfigError):
    """A SamplingParams field out of its range (REFERENCE 1.3)."""


class PoolingParamsError(ConfigError):
    """A PoolingParams field out of its range, or not a parameter of the request's task."""


class UnsupportedTaskError(ConfigError):
    """The model cannot do what was asked (generate on an embedding model, embed on a causal LM)."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__("task", message, hint=hint)


class InputError(VBatchError, ValueError):
    """A bad input record; carries file, line and field when known."""

    exit_code = 3

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 field: str | None = None, hint: str | None = None) -> None:
        where = ":".join(str(x) for x in (file, line) if x is not None)
        parts = [p for p in (where, field) if p]
        super().__init__(": ".join(parts + [message]), hint=hint)
        self.file, self.line, self.field = file, line, field


class ModelLoadError(VBatchError):
    """The model could not be found, fetched, converted or loaded."""

    exit_code = 4


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture has no vbatch implementation; lists the supported ones."""

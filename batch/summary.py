"""RunSummary: the numbers of one `vbatch run`, and their Rich table / JSON forms.

Built by `vbatch.batch.runner.run_batch`; printed on stderr by `vbatch run`; `--metrics-json`
writes `to_dict()`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RunSummary:
    num_requests: int
    num_ok: int
    num_errors: int
    prompt_tokens: int
    generated_tokens: int
    cached_prompt_tokens: int
    wall_time_s: float
    prefix_cache_hit_rate: float | None   # hits / queries from the engine; None when nothing was looked up
    num_preemptions: int
    peak_rss_bytes: int
    peak_device_bytes: int | None = None  # CUDA peak, when the engine ran on a GPU
    interrupted: bool = False             # stopped early (SIGINT/SIGTERM); the output stays resumable
    num_resumed: int = 0                  # records found done in the partial output and skipped
    command: str = "run"                  # "run" (generation) | "embed" (pooling: nothing generated)

    @property
    def generated_tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["generated_tokens_per_s"] = self.generated_tokens_per_s
        d["requests_per_s"] = self.requests_per_s
        return d

    def rich_table(self) -> Any:
        from rich.table import Table

        rate = "-" if self.prefix_cache_hit_rate is None else f"{100 * self.prefix_cache_hit_rate:.1f}%"
        table = Table(title=f"vbatch {self.command}", show_header=False)
        pooling = self.command != "run"
        per_s = self.prompt_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0
        tokens = ((("input tokens", f"{self.prompt_tokens:,}"), ("input tokens/s", f"{per_s:,.1f}")) if pooling else
                  (("prompt tokens", f"{self.prompt_tokens:,}"), ("generated tokens", f"{self.generated_tokens:,}"),
                   ("generated tokens/s", f"{self.generated_tokens_per_s:,.1f}")))
        cache = () if pooling else (("prefix cache hit rate", rate), ("preemptions", f"{self.num_preemptions:,}"))
        table.add_column("what", style="bold")
        table.add_column("value", justify="right")
        for what, value in (
            *((("resumed (skipped)", f"{self.num_resumed:,}"),) if self.num_resumed else ()),
            ("requests", f"{self.num_requests:,}"), ("ok", f"{self.num_ok:,}"), ("errors", f"{self.num_errors:,}"),
            *tokens, ("requests/s", f"{self.requests_per_s:,.2f}"), *cache,
            ("wall time", f"{self.wall_time_s:,.2f} s"),
            ("peak RSS", f"{self.peak_rss_bytes / 2**20:,.0f} MiB"),
            *((("peak GPU memory", f"{self.peak_device_bytes / 2**20:,.0f} MiB"),)
              if self.peak_device_bytes is not None else ()),
            *((("interrupted", "yes: rerun the same command to resume"),) if self.interrupted else ()),
        ):
            table.add_row(what, value)
        return table

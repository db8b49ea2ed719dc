"""The fixed Arrow schema of Parquet outputs, so every row group agrees whatever its rows hold.

Two columns differ from the JSONL record because Arrow columns have one type:
`outputs[].stop_reason` is a string (a stop token id is written as its decimal string) and
`extra` is a JSON string (null when empty). Used by `vbatch.batch.writers.ParquetWriter`.
"""
from __future__ import annotations

import json
from typing import Any


def parquet_schema() -> Any:
    import pyarrow as pa

    logprob = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64()), ("rank", pa.int64()),
                         ("token", pa.string())])
    positions = pa.list_(pa.list_(logprob))  # [num_positions][num_candidates]
    completion = pa.struct([
        ("index", pa.int64()), ("text", pa.string()), ("token_ids", pa.list_(pa.int64())),
        ("cumulative_logprob", pa.float64()), ("logprobs", positions), ("finish_reason", pa.string()),
        ("stop_reason", pa.string()),
    ])
    metrics = pa.struct([
        ("arrival_time", pa.float64()), ("first_scheduled_time", pa.float64()),
        ("first_token_time", pa.float64()), ("last_token_time", pa.float64()),
        ("finished_time", pa.float64()), ("num_generation_tokens", pa.int64()), ("num_preemptions", pa.int64()),
    ])
    return pa.schema([
        ("id", pa.string()), ("request_id", pa.string()), ("prompt", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int64())), ("prompt_logprobs", positions),
        ("outputs", pa.list_(completion)), ("finished", pa.bool_()), ("metrics", metrics),
        ("num_cached_tokens", pa.int64()), ("error", pa.string()), ("extra", pa.string()),
    ])


def to_parquet_row(record: dict[str, Any]) -> dict[str, Any]:
    row = dict(record)
    row["outputs"] = [{**o, "stop_reason": None if o.get("stop_reason") is None else str(o["stop_reason"])}
                      for o in record.get("outputs") or []]
    extra = record.get("extra")
    row["extra"] = json.dumps(extra) if extra else None
    return row

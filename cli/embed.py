"""`vbatch embed FILE -o OUT`: one embedding per record of a batch file, outputs in input order.

Records: `{"id", "text"}` (or `prompt`, or OpenAI's `input`; `prompt_token_ids`) in JSONL or
Parquet, or OpenAI Batch `/v1/embeddings` lines; outputs `{"id", "embedding", "num_tokens"}`
(Parquet: a fixed-size list column) or OpenAI Batch response lines. The same streaming,
validation before the model loads, per-record errors, resume, shards, progress and summary as
`vbatch run` (cli/batch_job.py): only what a record becomes and what an output holds differ.
"""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from . import options as o
from .errors import handle_errors
from . import run as run_cmd
from .run import engine_kwargs

POOLING = "Pooling defaults"

Normalize = Annotated[bool, typer.Option("--normalize/--no-normalize", help="L2-normalise each embedding.",
                                         rich_help_panel=POOLING)]
Dimensions = Annotated[Optional[int], typer.Option(help="Keep the first N values (matryoshka models only).",
                                                  rich_help_panel=POOLING)]
Truncate = Annotated[Optional[int], typer.Option("--truncate", help="Cut inputs to their first N tokens, special "
                                                 "tokens kept (-1: to the model's limit). Default: a longer input "
                                                 "is an error record.", rich_help_panel=POOLING)]


@handle_errors
def embed(
    file: o.InputFile,
    output: o.Output = "-",
    model: o.Model = "all-minilm-l6-v2",
    dtype: o.Dtype = "auto",
    max_model_len: o.MaxModelLen = None,
    max_num_seqs: o.MaxNumSeqs = None,
    max_num_batched_tokens: o.MaxNumBatchedTokens = None,
    device: o.Device = None,
    normalize: Normalize = True,
    dimensions: Dimensions = None,
    truncate: Truncate = None,
    max_in_flight: o.MaxInFlight = None,
    metrics_json: o.MetricsJson = None,
    on_error: o.OnError = "record",
    strict: o.Strict = False,
    shard: o.Shard = None,
    resume: o.Resume = True,
    overwrite: o.Overwrite = False,
    wait_lock: o.WaitLock = False,
) -> None:
    """Embed every record of FILE with a pooling model; write one output record per input record, in order.

    A killed or interrupted run leaves OUT.partial; the same command resumes it.
    """
    from ..batch.jobs import PoolingJob
    from ..engine.errors import ConfigError, PoolingParamsError
    from ..engine.pooling_params import PoolingParams

    from .batch_job import JobSpec, run_job

    try:
        params = PoolingParams(normalize=normalize, dimensions=dimensions, truncate_prompt_tokens=truncate)
    except PoolingParamsError as e:
        raise ConfigError("--" + {"truncate_prompt_tokens": "truncate"}.get(e.field, e.field),
                          str(e)[len(e.field) + 2:]) from None
    if max_in_flight is not None and max_in_flight < 1:
        raise ConfigError("--max-in-flight", f"must be >= 1, got {max_in_flight}")
    kwargs = engine_kwargs(dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=None,
                           enable_prefix_caching=None, seed=None, generation_config=None, device=device)
    pooling = {k: v for k, v in params.to_dict().items() if k != "extra_kwargs"}
    spec = JobSpec(
        command="embed", file=file, output=output, model=model, engine_kwargs=kwargs,
        output_options={"model": model, "dtype": dtype, "max_model_len": max_model_len, "pooling": pooling},
        make_job=lambda llm: PoolingJob(params, "embed"), pooling=True, reader_kind="embed", record_kind="embed",
        max_in_flight=max_in_flight or 4 * (max_num_seqs or 256), metrics_json=metrics_json,
        on_error="fail" if strict else on_error, shard=shard, resume=resume, overwrite=overwrite,
        wait_lock=wait_lock)
    run_job(spec, lambda name, kw: run_cmd.load_llm(name, kw))  # the one seam where tests replace the engine

"""`vbatch run FILE -o OUT`: generate for every record of a batch file, outputs in input order.

Only wiring: options -> engine kwargs and sampling defaults; reader, writer, resume, shards and
the streaming loop live in `vbatch.batch`. Order of work: options, input and output checks, the
resume plan (complete / resume / another run's output), the first validation pass, and only then
the model, so a typo or a finished output costs no model load.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import typer

from . import options as o
from .errors import EXIT_BAD_INPUT, EXIT_RECORDS_FAILED, handle_errors

MAX_LISTED_ERRORS = 20  # failed records listed under the summary (all of them are in the output)


def resolve_chat_template(value: str | None) -> str | None:
    """A `--chat-template` value: the text of a file, or the inline Jinja template itself."""
    from ..engine.errors import ConfigError

    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError("--chat-template", f"{value!r} is neither a file nor a Jinja template",
                      hint="pass a path to a .jinja file or the template text itself")


def engine_kwargs(*, dtype: str, max_model_len: int | None, max_num_seqs: int | None,
                  max_num_batched_tokens: int | None, kv_cache_memory: str | None,
                  enable_prefix_caching: bool | None, seed: int | None, generation_config: str | None,
                  device: str | None, weight_dtype: str = "auto", kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """vbatch.LLM keyword arguments for the flags the user set (unset flags keep the engine's defaults)."""
    from ..engine.config import parse_bytes

    kwargs: dict[str, Any] = {"dtype": dtype, "weight_dtype": None if weight_dtype == "auto" else weight_dtype,
                              "kv_cache_dtype": None if kv_cache_dtype == "auto" else kv_cache_dtype,
                              "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                              "max_num_batched_tokens": max_num_batched_tokens,
                              "enable_prefix_caching": enable_prefix_caching, "seed": seed,
                              "generation_config": generation_config, "device": device}
    if kv_cache_memory is not None:
        kwargs["kv_cache_memory"] = parse_bytes(kv_cache_memory, "--kv-cache-memory")
    return {k: v for k, v in kwargs.items() if v is not None}


def load_llm(model: str, kwargs: dict[str, Any]) -> Any:
    """SEAM: the one place `vbatch run` builds the engine (tests replace it)."""
    from .. import LLM
    from ..engine.errors import ModelLoadError

    try:
        return LLM(model=model, **kwargs)
    except OSError as e:
        raise ModelLoadError(f"cannot load model {model!r}: {e}", hint="see `vbatch models list`") from e


def output_options(*, model: str, dtype: str, max_model_len: int | None, seed: int | None,
                   generation_config: str | None, chat_template: str | None,
                   defaults: dict[str, Any], weight_dtype: str = "auto",
                   kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """The options that change what an output record holds: a resumed run must use the same ones.
    (The storage dtypes only when set, so manifests written before the options existed still match.)"""
    digest = hashlib.sha256(chat_template.encode()).hexdigest() if chat_template is not None else None
    options = {"model": model, "dtype": dtype, "max_model_len": max_model_len, "seed": seed,
               "generation_config": generation_config, "chat_template_sha256": digest, "sampling_defaults": defaults}
    storage = {"weight_dtype": weight_dtype, "kv_cache_dtype": kv_cache_dtype}
    return options | {k: v for k, v in storage.items() if v != "auto"}


def first_pass(reader: Any, shard: Any, *, on_error: str) -> int:
    """Validate the shard's records before the model loads (like vLLM): print each problem; return the count.

    `--on-error fail` stops here with exit 3 when any record is bad.
    """
    from ..batch.record import RecordError

    num_records = num_problems = 0
    for rec in shard.select(reader):
        num_records += 1
        if isinstance(rec, RecordError):
            num_problems += 1
            typer.echo(str(rec), err=True)
    if num_problems and on_error == "fail":
        typer.echo(f"{num_problems} bad records; nothing was run (--on-error record runs the rest)", err=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    if num_problems:
        typer.echo(f"{num_problems} bad records: each gets an error record in its place", err=True)
    return num_records


@handle_errors
def run(
    file: o.InputFile,
    output: o.Output = "-",
    model: o.Model = "smollm2-135m-instruct",
    dtype: o.Dtype = "auto",
    weight_dtype: o.WeightDtype = "auto",
    kv_cache_dtype: o.KvCacheDtype = "auto",
    max_model_len: o.MaxModelLen = None,
    max_num_seqs: o.MaxNumSeqs = None,
    max_num_batched_tokens: o.MaxNumBatchedTokens = None,
    kv_cache_memory: o.KvCacheMemory = None,
    enable_prefix_caching: o.EnablePrefixCaching = None,
    seed: o.Seed = None,
    generation_config: o.GenerationConfig = None,
    chat_template: o.ChatTemplate = None,
    device: o.Device = None,
    temperature: o.Temperature = None, top_p: o.TopP = None, top_k: o.TopK = None, min_p: o.MinP = None,
    max_tokens: o.MaxTokens = None, stop: o.Stop = None, presence_penalty: o.PresencePenalty = None,
    frequency_penalty: o.FrequencyPenalty = None, repetition_penalty: o.RepetitionPenalty = None,
    logprobs: o.Logprobs = None, n: o.N = None,
    max_in_flight: o.MaxInFlight = None,
    metrics_json: o.MetricsJson = None,
    on_error: o.OnError = "record",
    strict: o.Strict = False,
    shard: o.Shard = None,
    resume: o.Resume = True,
    overwrite: o.Overwrite = False,
) -> None:
    """Run every record of FILE through the model; write one output record per input record, in order.

    A killed or interrupted run leaves OUT.partial; the same command resumes it.
    """
    from rich.console import Console

    from ..batch.atomic_file import partial_path
    from ..batch.manifest import Manifest, write_manifest
    from ..batch.readers import open_reader
    from ..batch.resume import OutputPlan, plan_output, remove_output, skip_done
    from ..batch.runner import run_batch
    from ..batch.shard import part_path, resolve_shard
    from ..batch.writers import check_output, open_writer
    from ..engine.errors import ConfigError

    from .progress import make_progress
    from .signals import StopSignals

    # 1. everything that can be checked without the model
    defaults = o.sampling_defaults(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, max_tokens=max_tokens, stop=stop,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty, logprobs=logprobs, n=n)
    kwargs = engine_kwargs(dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
                           enable_prefix_caching=enable_prefix_caching, seed=seed,
                           generation_config=generation_config, device=device, weight_dtype=weight_dtype,
                           kv_cache_dtype=kv_cache_dtype)
    template = resolve_chat_template(chat_template)
    if max_in_flight is not None and max_in_flight < 1:
        raise ConfigError("--max-in-flight", f"must be >= 1, got {max_in_flight}")
    if on_error not in ("record", "fail"):
        raise ConfigError("--on-error", f"must be record or fail, got {on_error!r}")
    on_error = "fail" if strict else on_error
    the_shard = resolve_shard(shard)
    if output == "-" and not the_shard.is_whole:
        raise ConfigError(the_shard.source, "a shard writes OUT.part-I-of-N: give -o OUT",
                          hint="or unset VBATCH_SHARD / run outside the Slurm array")
    reader = open_reader(file, sampling_defaults=defaults)
    fmt = check_output(output, input_format=reader.format)
    if file == "-" and on_error == "fail":
        raise ConfigError("--on-error", "fail needs a file: stdin cannot be read twice")

    # 2. what is already there: complete, resumable, or another run's (refused before any model load)
    target = part_path(output, the_shard)
    plan, manifest = OutputPlan("fresh"), None
    if output != "-":
        manifest = Manifest.build(file, output_options(
            model=model, dtype=dtype, max_model_len=max_model_len, seed=seed, generation_config=generation_config,
            chat_template=template, defaults=defaults, weight_dtype=weight_dtype, kv_cache_dtype=kv_cache_dtype),
            fmt, the_shard.spec())
        plan = plan_output(target, manifest, resume=resume, overwrite=overwrite)
        if plan.action == "complete":
            typer.echo(f"{target}: already complete ({plan.num_done} records); nothing to do", err=True)
            return
        if plan.action == "resume":
            typer.echo(f"{target}: resuming after {plan.num_done} records already done"
                       + (f" (cut a torn last line of {plan.num_trimmed_bytes} bytes)" if plan.num_trimmed_bytes
                          else ""), err=True)
    if not the_shard.is_whole:
        typer.echo(f"shard {the_shard.spec()} (from {the_shard.source}) -> {target}", err=True)
    total = first_pass(reader, the_shard, on_error=on_error) if file != "-" else None
    if plan.action == "replace":
        remove_output(target)     # only now: `--on-error fail` on a bad file keeps the old output

    # 3. the model, then the streaming loop
    llm = load_llm(model, kwargs)
    if manifest is not None:
        write_manifest(target, manifest)  # before the partial's first line: a partial never lacks its manifest
    writer = open_writer(target, input_format=reader.format, model=model, append=plan.action == "resume", kind=fmt)
    records = skip_done(the_shard.select(reader), partial_path(target), plan.num_done,
                        id_key="custom_id" if fmt == "openai" else "id")
    progress = make_progress(None if total is None else total - plan.num_done)
    failures: list[str] = []

    def on_result(result: Any) -> None:
        progress.update(result)
        if not result.ok and len(failures) < MAX_LISTED_ERRORS:
            failures.append(f"id {result.id!r}: {result.error_message}")

    try:
        with StopSignals() as stop:
            result = run_batch(records, writer, llm, defaults,
                               max_in_flight=max_in_flight or 2 * (max_num_seqs or 256),
                               chat_template=template, on_result=on_result, should_stop=stop.is_set,
                               first_seq=plan.num_done)
    except BaseException:
        writer.abort()
        raise
    finally:
        progress.close()
    result = dataclasses.replace(result, num_resumed=plan.num_done)
    if result.interrupted:
        writer.abort()
    else:
        writer.close()
        if manifest is not None:
            write_manifest(target, manifest.completed(plan.num_done + result.num_requests))

    # 4. the summary
    Console(stderr=True).print(result.rich_table())
    if failures:
        typer.echo(f"errors (first {len(failures)} of {result.num_errors}):", err=True)
        for line in failures:
            typer.echo(f"  {line}", err=True)
    if metrics_json is not None:
        metrics_json.write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
    if result.interrupted:
        typer.echo(f"stopped by {stop.name}: {result.num_requests} records written this run; "
                   f"rerun the same command to resume ({partial_path(target)})", err=True)
        raise typer.Exit(stop.exit_code)
    if result.num_errors or plan.num_done_errors:  # the whole output, the resumed part included
        raise typer.Exit(EXIT_RECORDS_FAILED)

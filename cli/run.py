"""`vbatch run FILE -o OUT`: generate for every record of a batch file, outputs in input order.

Only wiring: options -> engine kwargs and sampling defaults; reader, writer and the streaming
loop live in `vbatch.batch` (readers, writers, runner). The engine is imported lazily, after
the input and output have been checked, so a typo costs no model load.
"""
from __future__ import annotations

import json
import os
from typing import Any

import typer

from . import options as o
from .errors import EXIT_BAD_INPUT, EXIT_RECORDS_FAILED, handle_errors


def resolve_chat_template(value: str | None) -> str | None:
    """A `--chat-template` value: the text of a file, or the inline Jinja template itself."""
    from vbatch.engine.errors import ConfigError

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
                  device: str | None) -> dict[str, Any]:
    """vbatch.LLM keyword arguments for the flags the user set (unset flags keep the engine's defaults)."""
    from vbatch.engine.config import parse_bytes

    kwargs: dict[str, Any] = {"dtype": dtype, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                              "max_num_batched_tokens": max_num_batched_tokens,
                              "enable_prefix_caching": enable_prefix_caching, "seed": seed,
                              "generation_config": generation_config, "device": device}
    if kv_cache_memory is not None:
        kwargs["kv_cache_memory"] = parse_bytes(kv_cache_memory, "--kv-cache-memory")
    return {k: v for k, v in kwargs.items() if v is not None}


def load_llm(model: str, kwargs: dict[str, Any]) -> Any:
    """SEAM: the one place `vbatch run` builds the engine (tests replace it)."""
    from vbatch import LLM
    from vbatch.engine.errors import ModelLoadError

    try:
        return LLM(model=model, **kwargs)
    except OSError as e:
        raise ModelLoadError(f"cannot load model {model!r}: {e}", hint="see `vbatch models list`") from e


@handle_errors
def run(
    file: o.InputFile,
    output: o.Output = "-",
    model: o.Model = "smollm2-135m-instruct",
    dtype: o.Dtype = "auto",
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
    strict: o.Strict = False,
) -> None:
    """Run every record of FILE through the model; write one output record per input record, in order."""
    from rich.console import Console

    from vbatch.batch.readers import open_reader
    from vbatch.batch.runner import run_batch
    from vbatch.batch.validation import validate_reader
    from vbatch.batch.writers import check_output, open_writer
    from vbatch.engine.errors import ConfigError

    from .progress import make_progress

    # 1. everything that can be checked without the model
    defaults = o.sampling_defaults(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, max_tokens=max_tokens, stop=stop,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty, logprobs=logprobs, n=n)
    kwargs = engine_kwargs(dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
                           enable_prefix_caching=enable_prefix_caching, seed=seed,
                           generation_config=generation_config, device=device)
    template = resolve_chat_template(chat_template)
    if max_in_flight is not None and max_in_flight < 1:
        raise ConfigError("--max-in-flight", f"must be >= 1, got {max_in_flight}")
    reader = open_reader(file, sampling_defaults=defaults)
    check_output(output, input_format=reader.format)
    if strict:
        if file == "-":
            raise ConfigError("--strict", "needs a file: stdin cannot be read twice")
        summary = validate_reader(reader, lambda problem: typer.echo(str(problem), err=True))
        if not summary.is_clean:
            typer.echo(f"{summary.num_problems} bad records; nothing was run (drop --strict to run the rest)",
                       err=True)
            raise typer.Exit(EXIT_BAD_INPUT)

    # 2. the model, then the streaming loop
    llm = load_llm(model, kwargs)
    progress = make_progress(reader.count())
    writer = open_writer(output, input_format=reader.format, model=model)
    try:
        result = run_batch(reader, writer, llm, defaults,
                           max_in_flight=max_in_flight or 2 * (max_num_seqs or 256),
                           chat_template=template, on_result=progress.update)
    except BaseException:
        writer.abort()
        raise
    finally:
        progress.close()
    writer.close()

    # 3. the summary
    Console(stderr=True).print(result.rich_table())
    if metrics_json is not None:
        metrics_json.write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
    if result.num_errors:
        raise typer.Exit(EXIT_RECORDS_FAILED)

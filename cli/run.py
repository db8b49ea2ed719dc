"""`vbatch run FILE -o OUT`: generate for every record of a batch file, outputs in input order.

Only wiring: options -> engine kwargs, sampling defaults and the generation job; the body every
batch command shares (checks, resume, the model, the streaming loop, the summary) is
cli/batch_job.py, and the reader, writer, resume, shards and loop live in `vbatch.batch`.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any

import typer

from . import options as o
from .errors import handle_errors


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
                  device: str | None, weight_dtype: str = "auto", kv_cache_dtype: str = "auto",
                  quantization: str | None = None, num_scheduler_steps: int | None = None) -> dict[str, Any]:
    """vbatch.LLM keyword arguments for the flags the user set (unset flags keep the engine's defaults)."""
    from ..engine.config import parse_bytes

    kwargs: dict[str, Any] = {"dtype": dtype, "weight_dtype": None if weight_dtype == "auto" else weight_dtype,
                              "kv_cache_dtype": None if kv_cache_dtype == "auto" else kv_cache_dtype,
                              "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                              "max_num_batched_tokens": max_num_batched_tokens,
                              "enable_prefix_caching": enable_prefix_caching, "seed": seed,
                              "generation_config": generation_config, "device": device, "quantization": quantization,
                              "num_scheduler_steps": num_scheduler_steps}
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
                   kv_cache_dtype: str = "auto", quantization: str | None = None) -> dict[str, Any]:
    """The options that change what an output record holds: a resumed run must use the same ones.
    (The storage dtypes only when set, so manifests written before the options existed still match.)"""
    digest = hashlib.sha256(chat_template.encode()).hexdigest() if chat_template is not None else None
    options = {"model": model, "dtype": dtype, "max_model_len": max_model_len, "seed": seed,
               "generation_config": generation_config, "chat_template_sha256": digest, "sampling_defaults": defaults}
    storage = {"weight_dtype": weight_dtype, "kv_cache_dtype": kv_cache_dtype, "quantization": quantization}
    return options | {k: v for k, v in storage.items() if v not in ("auto", None)}


@handle_errors
def run(
    file: o.InputFile,
    output: o.Output = "-",
    model: o.Model = "smollm2-135m-instruct",
    dtype: o.Dtype = "auto",
    weight_dtype: o.WeightDtype = "auto",
    quantization: o.Quantization = None,
    kv_cache_dtype: o.KvCacheDtype = "auto",
    max_model_len: o.MaxModelLen = None,
    max_num_seqs: o.MaxNumSeqs = None,
    num_scheduler_steps: o.NumSchedulerSteps = None,
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
    wait_lock: o.WaitLock = False,
) -> None:
    """Run every record of FILE through the model; write one output record per input record, in order.

    A killed or interrupted run leaves OUT.partial; the same command resumes it.
    """
    from ..batch.jobs import GenerateJob
    from ..engine.errors import ConfigError

    from .batch_job import JobSpec, run_job

    defaults = o.sampling_defaults(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, max_tokens=max_tokens, stop=stop,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty, logprobs=logprobs, n=n)
    kwargs = engine_kwargs(dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
                           enable_prefix_caching=enable_prefix_caching, seed=seed,
                           generation_config=generation_config, device=device, weight_dtype=weight_dtype,
                           kv_cache_dtype=kv_cache_dtype, quantization=quantization,
                           num_scheduler_steps=num_scheduler_steps)
    template = resolve_chat_template(chat_template)
    if max_in_flight is not None and max_in_flight < 1:
        raise ConfigError("--max-in-flight", f"must be >= 1, got {max_in_flight}")
    spec = JobSpec(
        command="run", file=file, output=output, model=model, engine_kwargs=kwargs,
        output_options=output_options(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed,
                                      generation_config=generation_config, chat_template=template,
                                      defaults=defaults, weight_dtype=weight_dtype, kv_cache_dtype=kv_cache_dtype,
                                      quantization=quantization),
        make_job=lambda llm: GenerateJob(llm, defaults, template), sampling_defaults=defaults,
        max_in_flight=max_in_flight or 2 * (max_num_seqs or 256), metrics_json=metrics_json,
        on_error="fail" if strict else on_error, shard=shard, resume=resume, overwrite=overwrite,
        wait_lock=wait_lock)
    run_job(spec, lambda name, kw: load_llm(name, kw))   # looked up per call: tests replace load_llm

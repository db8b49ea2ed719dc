"""Shared `Annotated` option aliases: one definition per flag, reused by every command.

Engine flags use vLLM's names; sampling flags set the defaults every record starts from
(a record's own sampling_params win; the model's generation_config fills what neither sets).
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

ENGINE = "Engine"
SAMPLING = "Sampling defaults"
RUN = "Run"

InputFile = Annotated[str, typer.Argument(help="Batch file: .jsonl, .parquet or an OpenAI Batch .jsonl; - reads stdin.",
                                          show_default=False)]

# ------------------------------------------------------------------ engine
Model = Annotated[str, typer.Option("--model", "-m", help="Local HF folder, .gguf file or catalogue name "
                                    "(`vbatch models list`).", rich_help_panel=ENGINE)]
Dtype = Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16.", rich_help_panel=ENGINE)]
WeightDtype = Annotated[str, typer.Option(help="auto | float32 | float16 | bfloat16: how linear weights are stored "
                                          "(auto: fp16 under an fp32 model on CPUs without fast bf16, widened in "
                                          "registers; float32 keeps them exact).", rich_help_panel=ENGINE)]
Quantization = Annotated[Optional[str], typer.Option(
    help="q8_0: quantize the linear weights at load (int8 + an fp16 scale per 32, as llama.cpp's Q8_0; "
         "fp32 arithmetic, CPU only): about half the bytes of fp16 per decode step, a small accuracy cost "
         "(docs/performance/q8_0.md). Unset: no quantization.", rich_help_panel=ENGINE)]
KvCacheDtype = Annotated[str, typer.Option(help="auto | float32 | float16 | bfloat16 | fp8 | fp8_e4m3 | fp8_e5m2: "
                                           "how the KV cache is stored (auto: like the weights; fp8 = fp8_e4m3, one "
                                           "byte per value on the CPU, scale 1.0 as vLLM's default: fewer bytes for "
                                           "decode attention to read, an accuracy cost).", rich_help_panel=ENGINE)]
MaxModelLen = Annotated[Optional[int], typer.Option(help="Prompt + output tokens per sequence "
                                                   "(default: the model's).", rich_help_panel=ENGINE)]
MaxNumSeqs = Annotated[Optional[int], typer.Option(help="Most sequences running at once (default: 256).",
                                                  rich_help_panel=ENGINE)]
NumSchedulerSteps = Annotated[Optional[int], typer.Option(
    help="Forwards one engine step may run when every running request decodes with plain sampling "
         "(greedy or temperature only) and no waiting request has room (vLLM's multi-step scheduling; "
         "default: 8 on CPUs with the native kernels, else 1). 1 turns it off.", rich_help_panel=ENGINE)]
MaxNumBatchedTokens = Annotated[Optional[int], typer.Option(help="Token budget of one engine step "
                                                           "(default: 8192).", rich_help_panel=ENGINE)]
KvCacheMemory = Annotated[Optional[str], typer.Option(help="KV cache size, e.g. 2GiB or 512MiB "
                                                     "(default: sized from free memory).", rich_help_panel=ENGINE)]
EnablePrefixCaching = Annotated[Optional[bool], typer.Option(
    "--enable-prefix-caching/--no-enable-prefix-caching",
    help="Reuse KV blocks of shared prompt prefixes (default: on).", show_default=False, rich_help_panel=ENGINE)]
Seed = Annotated[Optional[int], typer.Option(help="Engine seed for requests without their own seed (default: 0).",
                                            rich_help_panel=ENGINE)]
GenerationConfig = Annotated[Optional[str], typer.Option(
    help="auto (the model's generation_config.json) | vllm (neutral) | a folder holding one (default: auto).",
    rich_help_panel=ENGINE)]
ChatTemplate = Annotated[Optional[str], typer.Option(help="Jinja chat template: a file path or the template text "
                                                    "(default: the model's).", rich_help_panel=ENGINE)]
Device = Annotated[Optional[str], typer.Option(help="auto | cpu | cuda | cuda:N (default: auto).",
                                              rich_help_panel=ENGINE)]

# ------------------------------------------------------------------ sampling defaults
Temperature = Annotated[Optional[float], typer.Option(help="0 means greedy.", rich_help_panel=SAMPLING)]
TopP = Annotated[Optional[float], typer.Option(rich_help_panel=SAMPLING)]
TopK = Annotated[Optional[int], typer.Option(help="0 or -1 disables.", rich_help_panel=SAMPLING)]
MinP = Annotated[Optional[float], typer.Option(rich_help_panel=SAMPLING)]
MaxTokens = Annotated[Optional[int], typer.Option(help="Most tokens generated per output (default: 16 "
                                                 "unless the generation_config sets it).", rich_help_panel=SAMPLING)]
Stop = Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable).",
                                                  rich_help_panel=SAMPLING)]
PresencePenalty = Annotated[Optional[float], typer.Option(rich_help_panel=SAMPLING)]
FrequencyPenalty = Annotated[Optional[float], typer.Option(rich_help_panel=SAMPLING)]
RepetitionPenalty = Annotated[Optional[float], typer.Option(rich_help_panel=SAMPLING)]
Logprobs = Annotated[Optional[int], typer.Option(help="Top-k logprobs per generated token (0..20).",
                                                rich_help_panel=SAMPLING)]
N = Annotated[Optional[int], typer.Option("--n", help="Outputs per prompt.", rich_help_panel=SAMPLING)]

# ------------------------------------------------------------------ run
Output = Annotated[str, typer.Option("--output", "-o", help="Output file; .jsonl or .parquet picks the format "
                                     "(OpenAI Batch input always writes OpenAI Batch JSONL); - for stdout.",
                                     rich_help_panel=RUN)]
MaxInFlight = Annotated[Optional[int], typer.Option(help="Most records inside the engine at once "
                                                   "(default: 2 x max-num-seqs).", rich_help_panel=RUN)]
MetricsJson = Annotated[Optional[Path], typer.Option(help="Also write the run summary as JSON here.",
                                                    rich_help_panel=RUN)]
OnError = Annotated[str, typer.Option("--on-error", help="record: a bad record becomes an error record in "
                                      "its place and the run goes on; fail: validate the whole file first and "
                                      "exit 3 before loading the model.", rich_help_panel=RUN)]
Strict = Annotated[bool, typer.Option("--strict", help="Alias of --on-error fail.", hidden=True,
                                      rich_help_panel=RUN)]
Shard = Annotated[Optional[str], typer.Option("--shard", help="I/N: run the records whose 0-based position % N "
                                              "== I, writing OUT.part-I-of-N (default: VBATCH_SHARD, else the "
                                              "Slurm array task; 0/1 is the whole input).", rich_help_panel=RUN)]
Resume = Annotated[bool, typer.Option("--resume/--no-resume", help="Continue a partial output of the same input "
                                      "and options, skipping the records already done.", rich_help_panel=RUN)]
WaitLock = Annotated[bool, typer.Option("--wait-lock", help="If another run is writing the same output, wait "
                                       "for it to finish instead of exiting (code 6).", rich_help_panel=RUN)]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Delete an existing output (final, partial, "
                                         "manifest) and start over.", rich_help_panel=RUN)]


def sampling_defaults(**flags: object) -> dict[str, object]:
    """The sampling flags the user set (None = not set), checked as SamplingParams.

    A bad value is a ConfigError naming the flag (exit 2), not a problem in every record.
    """
    from ..engine.errors import ConfigError, SamplingParamsError
    from ..engine.sampling_params import SamplingParams

    chosen = {k: v for k, v in flags.items() if v is not None and v != []}
    try:
        SamplingParams.from_dict(chosen)
    except SamplingParamsError as e:
        prefix = f"{e.field}: "
        msg = str(e)[len(prefix):] if str(e).startswith(prefix) else str(e)
        raise ConfigError("--" + e.field.replace("_", "-"), msg) from None
    return chosen

"""`vbatch bench throughput`: vLLM's offline throughput benchmark for vbatch (and `--latency`, batch 1).

Only wiring: flags -> prompts (`bench_dataset`), an engine built untimed, one timed run
(`bench_measure`), optional ceilings (`bench_ceilings`), a printed summary and `--json`.
`bench/peers.py` runs this command as the vbatch side of its comparison.
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from . import options as o
from .errors import handle_errors

app = typer.Typer(help="Benchmark vbatch on this machine (vLLM's `bench throughput` semantics).",
                  no_args_is_help=True)

BENCH = "Benchmark"


def _echo(line: str) -> None:
    typer.echo(line, err=True)


def _summary_lines(report: dict[str, Any]) -> list[str]:
    gemm = f", {report['cpu_gemm']} GEMMs" if report.get("cpu_gemm") else ""
    weights = "".join(f", {report[key]} {what}" for key, what in (("weight_dtype", "weights"), ("kv_cache_dtype", "KV cache"))
                      if report.get(key, report["dtype"]) != report["dtype"])
    tier = f", {report['cpu_tier']} kernels" if report.get("cpu_tier") else ""
    wait = f", {report['openmp_wait']}" if report.get("openmp_wait") else ""
    steps = f", up to {report['decode_steps']} decode steps a call" if report.get("decode_steps", 1) > 1 else ""
    huge = ", weights and KV cache on huge pages" if report.get("huge_pages") else ""
    huge += f", {report['torch_huge_pages']}" if report.get("torch_huge_pages") else ""
    threads = report.get("thread_budget") or f"{report['threads']} threads"
    lines = [f"model {report['model']} ({report['dtype']}{weights}{tier}, {threads}{wait}{gemm}{steps}"
             f"{huge}), "
             f"engine built in {report['engine_build_s']:.1f} s (not timed)"]
    if report.get("compile_description"):
        lines.append(f"  compiled at start-up (inside the build): {report['compile_description']}")
    if "throughput" in report:
        r = report["throughput"]
        lines += [
            f"Throughput: {r['requests_per_s']:.2f} requests/s, {r['total_tokens_per_s']:.1f} total tokens/s, "
            f"{r['output_tokens_per_s']:.1f} output tokens/s",
            f"  {r['num_requests']} requests, {r['prompt_tokens']} prompt + {r['output_tokens']} output tokens "
            f"in {r['elapsed_s']:.2f} s",
            f"  prefill phase {r['prefill_phase_s']:.2f} s, decode phase {r['decode_phase_s']:.2f} s"
            + (f" ({r['decode_tokens_per_s']:.1f} tok/s)" if r["decode_tokens_per_s"] else ""),
        ]
    if "latency" in report:
        r = report["latency"]
        lines.append(f"Latency (batch 1, {r['prompt_tokens']} prompt + {r['output_tokens']} output tokens): "
                     f"median {r['median_s']:.3f} s over {len(r['seconds'])} runs, "
                     f"{r['output_tokens_per_s']:.1f} output tok/s"
                     + (f", decode {r['decode_tokens_per_s']:.1f} tok/s" if r["decode_tokens_per_s"] else ""))
    if "ceilings" in report:
        c = report["ceilings"]
        lines.append(f"Ceilings ({c['dtype']}, {c['weight_dtype']} weights, {c['num_linear_params'] / 1e6:.1f} M linear params; "
                     f"GEMM {c['gemm_gflops']:.0f} GFLOP/s, read {c['read_gb_s']:.1f} GB/s): "
                     f"compute {c['compute_tok_s']:.0f} tok/s, bandwidth {c['bandwidth_tok_s']:.0f} tok/s")
        for key, label in (("decode_fraction_of_compute", "large-batch decode / compute ceiling"),
                           ("decode_fraction_of_bandwidth", "batch-1 decode / bandwidth ceiling")):
            if key in c:
                lines.append(f"  {label}: {100 * c[key]:.0f}%")
    return lines


def _ceilings(llm, dtype: str, threads: int, report: dict[str, Any]) -> dict[str, Any]:
    from .bench_ceilings import ceilings_for, measure_rates

    rates = measure_rates(threads, dtypes=(dtype,) if dtype == "float32" else (dtype, "float32"))
    c = ceilings_for(llm.engine.hf_config, dtype, rates, weight_dtype=report.get("weight_dtype"))
    out = c.to_dict() | {"gemm_gflops": rates.gemm_gflops[dtype], "read_gb_s": rates.read_gb_s,
                         "copy_gb_s": rates.copy_gb_s}
    if "throughput" in report and report["throughput"]["decode_tokens_per_s"]:
        out["decode_fraction_of_compute"] = report["throughput"]["decode_tokens_per_s"] / c.compute_tok_s
    if "latency" in report and report["latency"]["decode_tokens_per_s"]:
        out["decode_fraction_of_bandwidth"] = report["latency"]["decode_tokens_per_s"] / c.bandwidth_tok_s
    return out


@app.command("throughput")
@handle_errors
def throughput(
    model: o.Model = "smollm2-135m-instruct",
    num_prompts: Annotated[int, typer.Option(help="Requests in the timed generate.", rich_help_panel=BENCH)] = 256,
    input_len: Annotated[str, typer.Option(help="Prompt tokens: a number (fixed) or LOW-HIGH (uniform).",
                                           rich_help_panel=BENCH)] = "128-512",
    output_len: Annotated[int, typer.Option(help="Output tokens per request (ignore_eos).",
                                            rich_help_panel=BENCH)] = 128,
    dataset: Annotated[str, typer.Option(help="random (lengths uniform in --input-len) | fixed (every prompt "
                                         "the top of --input-len). Token ids are random either way.",
                                         rich_help_panel=BENCH)] = "random",
    latency: Annotated[bool, typer.Option("--latency", help="Batch 1 instead: one prompt of the lowest "
                                          "--input-len, timed --num-iters times.", rich_help_panel=BENCH)] = False,
    num_iters: Annotated[int, typer.Option(help="--latency: timed iterations (after one warm-up).",
                                           rich_help_panel=BENCH)] = 5,
    ceilings: Annotated[bool, typer.Option("--ceilings", help="Also measure GEMM rate and memory bandwidth "
                                           "and print decode as a fraction of the ceilings.",
                                           rich_help_panel=BENCH)] = False,
    threads: Annotated[Optional[int], typer.Option(
        help="torch threads (default: the engine's, one per usable core).", rich_help_panel=BENCH)] = None,
    json_file: Annotated[Optional[Path], typer.Option("--json", help="Also write the results as JSON here.",
                                                      rich_help_panel=BENCH)] = None,
    dtype: o.Dtype = "auto",
    weight_dtype: o.WeightDtype = "auto",
    quantization: o.Quantization = None,
    kv_cache_dtype: o.KvCacheDtype = "auto",
    max_num_seqs: o.MaxNumSeqs = None,
    num_scheduler_steps: o.NumSchedulerSteps = None,
    max_num_batched_tokens: o.MaxNumBatchedTokens = None,
    max_model_len: o.MaxModelLen = None,
    kv_cache_memory: o.KvCacheMemory = None,
    seed: Annotated[int, typer.Option(help="Seeds the prompts and the engine.", rich_help_panel=BENCH)] = 0,
    device: o.Device = None,
) -> None:
    """Build the engine (untimed), then time one generate over --num-prompts random prompts."""
    import torch

    from .. import __version__
    from ..engine.errors import ConfigError

    from .bench_dataset import build_prompts, parse_length_range, prompts_digest, special_token_ids
    from .bench_measure import run_latency, run_throughput
    from .run import engine_kwargs, load_llm

    lengths = parse_length_range(input_len)
    if output_len < 1:
        raise ConfigError("--output-len", f"must be >= 1, got {output_len}")
    if num_iters < 1:
        raise ConfigError("--num-iters", f"must be >= 1, got {num_iters}")
    if threads is not None and threads < 1:
        raise ConfigError("--threads", f"must be >= 1, got {threads}")
    if max_model_len is not None and max_model_len < lengths.high + output_len:
        raise ConfigError("--max-model-len", f"{max_model_len} cannot hold the longest prompt plus --output-len "
                          f"({lengths.high} + {output_len}); ignore_eos runs need the whole length",
                          hint="raise --max-model-len or leave it unset")
    kwargs = engine_kwargs(dtype=dtype, max_model_len=max_model_len or lengths.high + output_len,
                           max_num_seqs=1 if latency else max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
                           enable_prefix_caching=False if latency else None, seed=seed,
                           generation_config="vllm", device=device, weight_dtype=weight_dtype,
                           kv_cache_dtype=kv_cache_dtype, quantization=quantization,
                           num_scheduler_steps=num_scheduler_steps)
    kwargs["quiet"] = True
    if threads is not None:
        kwargs["num_threads"] = threads  # the engine sets torch's thread count itself when it starts

    t0 = time.perf_counter()
    llm = load_llm(model, kwargs)
    build_s = time.perf_counter() - t0
    tokenizer = llm.get_tokenizer()
    vocab_size = int(llm.engine.hf_config.vocab_size)
    prompts = build_prompts(num_prompts=1 if latency else num_prompts,
                            input_len=type(lengths)(lengths.low, lengths.low) if latency else lengths,
                            vocab_size=vocab_size, excluded_ids=special_token_ids(tokenizer), seed=seed,
                            dataset=dataset)
    resolved_dtype = str(llm.engine.dtype).removeprefix("torch.")
    budget = llm.engine.runner.threads   # CPU: the team, fewer while other processes are busy (engine/cpu_threads.py)
    report: dict[str, Any] = {
        "system": "vbatch", "version": __version__, "model": model, "dtype": resolved_dtype,
        "threads": torch.get_num_threads() if budget is None else budget.configured, "engine_build_s": build_s,
        "dataset": dataset,
        "input_len": str(lengths), "output_len": output_len, "seed": seed, "prompts_digest": prompts_digest(prompts),
        "torch": torch.__version__, "python": platform.python_version(),
    }
    ops = llm.engine.runner.ops
    report["weight_dtype"] = ops.quantization or str(ops.weight_dtype or llm.engine.dtype).removeprefix("torch.")
    report["kv_cache_dtype"] = str(llm.engine.runner.kv_dtype).removeprefix("torch.")
    if ops.cpu_tier is not None:  # the CPU path: its tier of native kernels and the flags that chose it
        from ..kernels.cpu_features import detect
        report["cpu_tier"] = ops.cpu_tier.name if ops.native is not None else f"{ops.cpu_tier.name} (not built)"
        report["cpu_flags"] = detect().deciding_flags
        from ..kernels.openmp_env import describe
        report["openmp_wait"] = describe()   # how the OpenMP threads wait between parallel regions
        from ..kernels.thp_env import describe as describe_thp
        report["huge_pages"] = llm.engine.runner.huge_pages   # weights and KV cache (kernels/cpu_huge_pages.py)
        report["torch_huge_pages"] = describe_thp()          # torch's own allocations (kernels/thp_env.py)
    from ..kernels.cpu_linear import describe
    gemm = describe(llm.engine.runner.model)
    if gemm is not None:
        report["cpu_gemm"] = gemm   # the library behind the packed CPU linears
    report["decode_steps"] = llm.engine.config.scheduler.num_scheduler_steps   # multi-step decodes (engine/scheduler.py)
    compiled = llm.engine.runner.compile_times()
    report["compile"], report["compile_description"] = compiled.to_dict(), compiled.describe()
    if latency:
        _echo(f"latency: {num_iters} runs of 1 prompt x {output_len} tokens ...")
        report["latency"] = run_latency(llm, prompts[0], output_len, num_iters).to_dict()
    else:
        _echo(f"throughput: {len(prompts)} prompts ({lengths} tokens) x {output_len} output tokens ...")
        report["throughput"] = run_throughput(llm, prompts, output_len).to_dict()
    if budget is not None:   # the team's size over the run
        report["thread_budget"] = budget.describe()
    if ceilings:
        report["ceilings"] = _ceilings(llm, resolved_dtype, report["threads"], report)
    for line in _summary_lines(report):
        typer.echo(line)
    if json_file is not None:
        json_file.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")

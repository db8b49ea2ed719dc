"""The small-rows limit end to end: engines that differ only in the most rows their linears' small-rows
kernel takes (and with it the fused decoder layer and the multi-step decodes), built in one process
and alternated over the same prompts.

    python bench/small_rows_limit.py [--limits 16,32] [--num-prompts 24,32] [--input-len 128-512]
                                     [--output-len 128] [--rounds 6] [--threads 2] [--dtype auto]
                                     [--model smollm2-135m-instruct] [--quantization q8_0]

The limit is `CpuTier.small_rows_wider` (kernels/cpu_features.py), which PackedLinear takes where the
GEMM library multiplies a wider copy of the weights than the kernel streams (an fp32 model with fp16,
bf16 or Q8_0 storage: the avx2 tier's default); kernels/cpu_linear.py's NOTE records the races that set
it per tier. Each engine here is the default one with every native linear's `small_rows` set to its
limit before its first step (so its fused layers and its multi-step decodes, which the scheduler
sizes at engine start, follow it); the limit is the only difference. For each prompt count, each round runs every engine once on the same prompts (greedy,
ignore_eos, prefix caching off), in an order that rotates every round, and times the generate. Prints
a markdown table: output tok/s per round, the medians, each limit's median over the first's, the
rounds it won, and whether its greedy tokens equal the first limit's (they need not bit for bit: a
row the GEMM computes adds in another order than the kernel; session 26 found them equal).

Set VBATCH_CPU_TIER to race a lower tier. Run it in its own high-priority session on a shared
machine (REFERENCE 8):
    setsid --wait bash -c 'echo -19 > /proc/$$/autogroup; exec nice -n -19 "$@"' _ python bench/small_rows_limit.py
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time


def say(msg: str) -> None:
    print(f"[small-rows-limit {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def set_limit(llm, limit: int) -> tuple[int, ...]:
    """Every native linear of `llm`'s model takes up to `limit` rows in the small-rows kernel; the
    fused layers' cached state is dropped so it is rebuilt for that limit, and the scheduler told.
    Returns the limits the linears had (empty: no native small-rows linear to set)."""
    from vbatch.kernels.cpu_linear import PackedLinear

    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, PackedLinear) and m.small_rows > 0]
    own = tuple(sorted({m.small_rows for m in linears}))   # what the engine chose itself
    for m in linears:
        m.small_rows = limit
    for m in model.modules():
        if hasattr(m, "_vb_native_stack"):
            del m._vb_native_stack
    # the scheduler asked the runner once, at engine start, how many requests a multi-step decode takes
    llm.engine.scheduler.decode_steps_rows = llm.engine.runner.decode_steps_rows()
    return own


def fused_rows(llm) -> str:
    """The most rows the model's fused decoder layers take (cpu_native_ops' stack, built at the first
    decode step), or why none."""
    layers = getattr(llm.engine.runner.model, "layers", None)
    cached = getattr(layers[0], "_vb_native_stack", None) if layers else None
    if cached is None:
        return "no"
    return "no (a layer is not all native)" if cached[2] is None else str(cached[2].max_rows)


def build(args, limit: int, max_model_len: int):
    """The engine with `limit`, and the limits its linears had before (set_limit)."""
    from vbatch.cli.run import engine_kwargs, load_llm

    kwargs = engine_kwargs(dtype=args.dtype, max_model_len=max_model_len, max_num_seqs=None,
                           max_num_batched_tokens=None, kv_cache_memory=args.kv_cache_memory,
                           enable_prefix_caching=False, seed=0, generation_config="vllm", device="cpu",
                           quantization=args.quantization)
    kwargs.update(quiet=True, num_threads=args.threads)
    llm = load_llm(args.model, kwargs)
    own = set_limit(llm, limit)
    if not own:
        raise SystemExit("this engine has no native small-rows linears (no native kernels built?): nothing to race")
    return llm, own


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limits", type=ints, default=[16, 32], help="comma-separated limits; the first is the baseline")
    ap.add_argument("--num-prompts", type=ints, default=[24, 32], help="comma-separated prompt counts")
    ap.add_argument("--input-len", default="128-512")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="the model dtype (auto: the tier's; float32 on avx2)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default=None, help="q8_0: Q8_0 weights (their limit is 4 rows, kernels/cpu_q8_0_linear.py)")
    ap.add_argument("--kv-cache-memory", default="1GiB", help="each engine's KV cache")
    args = ap.parse_args(argv)

    from vbatch.cli.bench_dataset import build_prompts, parse_length_range, special_token_ids
    from vbatch.engine.sampling_params import SamplingParams
    from vbatch.kernels.cpu_native_ops import FUSED_LAYER_MAX_ROWS

    if not args.limits or any(not 1 <= v <= FUSED_LAYER_MAX_ROWS for v in args.limits):
        raise SystemExit(f"--limits: each from 1 to {FUSED_LAYER_MAX_ROWS} (cpu_linear_small.c's MAX_ROWS)")
    lengths = parse_length_range(args.input_len)
    engines, own = {}, ()
    for limit in args.limits:
        say(f"building the engine with limit {limit}")
        engines[limit], own = build(args, limit, lengths.high + args.output_len)
    first = engines[args.limits[0]]
    ops = first.engine.runner.ops
    tier = ops.cpu_tier.name if ops.cpu_tier is not None else "none"
    weights = ops.quantization or str(ops.weight_dtype or first.engine.dtype).removeprefix("torch.")
    say(f"tier {tier}, model dtype {str(first.engine.dtype).removeprefix('torch.')}, weights {weights}, "
        f"{args.threads} threads; the engine's own limit: {'/'.join(map(str, own))}")
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)
    vocab = int(first.engine.hf_config.vocab_size)
    excluded = special_token_ids(first.get_tokenizer())

    rows = []
    for n in args.num_prompts:
        prompts = build_prompts(num_prompts=n, input_len=lengths, vocab_size=vocab, excluded_ids=excluded, seed=0)
        requests = [{"prompt_token_ids": p} for p in prompts]
        for limit, llm in engines.items():   # warm-up: the first generate of each engine is not timed
            llm.generate(requests[:2], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4))
            if n == args.num_prompts[0]:
                say(f"limit {limit}: the fused decoder layers take up to {fused_rows(llm)} rows, the multi-step "
                    f"decodes up to {llm.engine.scheduler.decode_steps_rows} requests")
        rates: dict[int, list[float]] = {limit: [] for limit in args.limits}
        tokens: dict[int, list] = {}
        for r in range(args.rounds):
            order = args.limits[r % len(args.limits):] + args.limits[:r % len(args.limits)]
            for limit in order:
                start = time.monotonic()
                outputs = engines[limit].generate(requests, params)
                seconds = time.monotonic() - start
                rates[limit].append(n * args.output_len / seconds)
                tokens.setdefault(limit, [list(o.outputs[0].token_ids) for o in outputs])
            say(f"{n} prompts, round {r}: " + ", ".join(f"limit {v} {rates[v][-1]:.1f}" for v in args.limits))
        base = statistics.median(rates[args.limits[0]])
        for limit in args.limits:
            med = statistics.median(rates[limit])
            won = sum(a > b for a, b in zip(rates[limit], rates[args.limits[0]]))
            same = sum(a == b for a, b in zip(tokens[limit], tokens[args.limits[0]]))
            rows.append(f"| {n} | {limit} | {', '.join(f'{v:.1f}' for v in rates[limit])} | {med:.1f} | "
                        f"{med / base:.3f}x | {won} of {args.rounds} | {same} of {n} |")

    print(f"Tier {tier}, weights {weights}, {args.threads} threads; prompts of {lengths} tokens, "
          f"{args.output_len} out, greedy, {args.rounds} rounds (order rotating).\n")
    print(f"| prompts | limit | output tok/s per round | median | ÷ limit {args.limits[0]} | rounds faster "
          f"| requests with limit {args.limits[0]}'s greedy tokens |")
    print("|---:|---:|---|---:|---:|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

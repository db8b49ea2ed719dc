"""CPU throughput probe for the engine (the numbers in docs/performance/avx512-bf16.md come from here).

Not the official benchmark (`vbatch bench throughput` is); a small script to measure one engine
configuration several times in one process and print medians, with the machine's load.

    python bench/cpu_profile.py --num-prompts 64 --input-len 128 --output-len 64 --threads 2 --repeats 3
    python bench/cpu_profile.py ... --profile          # one cProfile'd run, top 25 by total time

On a shared machine run it in its own session at high priority (REFERENCE 8):
    setsid --wait bash -c 'echo -19 > /proc/$$/autogroup; exec nice -n -19 "$@"' _ python bench/cpu_profile.py ...
"""
from __future__ import annotations

import argparse
import random
import statistics
import time


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128, help="prompt length (min when --input-len-max is set)")
    ap.add_argument("--input-len-max", type=int, default=None, help="prompt lengths uniform in [input-len, this]")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    from vbatch import LLM, SamplingParams

    kwargs = {}
    if args.block_size is not None:
        kwargs["block_size"] = args.block_size
    if args.threads is not None:
        kwargs["num_threads"] = args.threads
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False,
              quiet=True, **kwargs)
    startup = time.perf_counter() - t0
    import torch
    eng = llm.engine
    print(f"engine: {eng.device}/{eng.dtype}, threads={torch.get_num_threads()}, "
          f"block_size={eng.config.cache.block_size}, start-up {startup:.1f}s, "
          f"warm-up/compile {getattr(eng.runner, 'warmup_seconds', 0.0):.1f}s")

    rng = random.Random(0)
    vocab = eng.vocab_size
    hi = args.input_len_max or args.input_len
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(rng.randint(args.input_len, hi))]}
               for _ in range(args.num_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm caches

    if args.profile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        llm.generate(prompts, sp)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return

    rates, totals = [], []
    for i in range(args.repeats):
        load = _loadavg()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp)
        dt = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(o.prompt_token_ids) for o in outs)
        rates.append(n_out / dt)
        totals.append((n_in + n_out) / dt)
        print(f"run {i}: {dt:.2f}s, {n_out / dt:.1f} output tok/s, {(n_in + n_out) / dt:.1f} total tok/s, "
              f"loadavg before {load}")
    print(f"median: {statistics.median(rates):.1f} output tok/s, {statistics.median(totals):.1f} total tok/s "
          f"({args.num_prompts} prompts, input {args.input_len}-{hi}, output {args.output_len}, "
          f"threads {torch.get_num_threads()}, loadavg after {_loadavg()})")


if __name__ == "__main__":
    main()

"""Where a throughput run's time goes: every op and Linear of the model timed, split by step kind.

    python bench/op_times.py [--num-prompts 128] [--threads 2] [--quantization q8_0] [--kv-cache-dtype fp8]

Runs the issue's workload shape (prompts of 128-512 random tokens, 128 output tokens, temperature
1, EOS ignored) through `LLM.generate` with a wall-clock timer around every `Ops` function, every
Linear module's forward (and a fused gate/up module's `silu_and_mul`) and the runner's
`execute_model`, and prints the seconds per name for steps that carry prompt tokens ("mixed")
and pure decode steps, then the steps' phases (schedule, inputs, forward, logits head, sampler,
scheduler update, output processing) in ms per step. Timers add a few microseconds per call; the
native call that runs every layer at small batch (1-4 rows; up to the tier's `small_rows_wider`,
16 or 32, on half-precision weights under fp32) is timed as one `decoder_layers`. Every step runs
alone (num_scheduler_steps 1), so each forward's ops are seen. docs/performance/avx512-bf16.md's round-5 and
round-6 breakdowns come from here.
Run it in its own high-priority session on a shared machine (REFERENCE 8):
    setsid --wait bash -c 'echo -19 > /proc/$$/autogroup; exec nice -n -19 "$@"' _ python bench/op_times.py
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import random
import time
from typing import Callable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--input-len-max", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default=None, help="q8_0: the optional int8 weights (kernels/q8_0.py)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto, float16, bfloat16, fp8, fp8_e5m2: the KV cache's storage")
    args = ap.parse_args()

    from vbatch import LLM, SamplingParams
    llm = LLM(args.model, max_num_seqs=256, enable_prefix_caching=False, quiet=True, num_threads=args.threads,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              num_scheduler_steps=1)   # one forward per step: a multi-step decode runs in one native call
    engine = llm.engine
    runner, model = engine.runner, engine.runner.model
    seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
    phases: dict[tuple[str, str], float] = collections.defaultdict(float)
    steps: collections.Counter = collections.Counter()
    kind = ["mixed"]

    def timed(fn: Callable, name: str, into: dict = seconds) -> Callable:
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            into[(kind[0], name)] += time.perf_counter() - t
            return out
        return wrapper

    ops = model.ops
    # What this CPU path has (the test reads it): the whole-layer call and a packed logits head
    # exist only where the ops provide them.
    print(f"ops {ops.name}: fused decoder layers {'on' if ops.decoder_layers else 'off'}, "
          f"logits head {'packed' if model.logits_head is not None else 'plain'}")
    wrapped = dataclasses.replace(ops, **{
        f.name: timed(getattr(ops, f.name), f.name) for f in dataclasses.fields(ops)
        if callable(getattr(ops, f.name)) and f.name not in ("pack_linear", "pack_gate_up")})
    for module in model.modules():
        if getattr(module, "ops", None) is ops:
            module.ops = wrapped
    for name, module in model.named_modules():
        if "Linear" in type(module).__name__ or "GateUp" in type(module).__name__:
            label = name.rsplit(".", 1)[-1] if "layers." in name else name
            module.forward = timed(module.forward, f"linear {label}")
            if hasattr(module, "silu_and_mul"):
                module.silu_and_mul = timed(module.silu_and_mul, f"linear {label} + silu_and_mul")
    schedule = engine.scheduler.schedule

    def schedule_and_classify():
        t = time.perf_counter()
        out = schedule()
        kind[0] = "decode" if out.num_scheduled_tokens == len(out.scheduled) else "mixed"
        phases[(kind[0], "schedule")] += time.perf_counter() - t
        steps[kind[0]] += not out.is_empty
        return out
    engine.scheduler.schedule = schedule_and_classify
    runner.execute_model = timed(runner.execute_model, "execute_model (all of the step's model work)")
    # The step's phases (a second table): the engine loop around the model.
    import vbatch.engine.model_runner as model_runner
    model_runner.prepare_inputs = timed(model_runner.prepare_inputs, "prepare_inputs", phases)
    model.forward = timed(model.forward, "model forward", phases)
    model.compute_logits = timed(model.compute_logits, "logits head", phases)
    runner._sample = timed(runner._sample, "sampler", phases)
    engine.scheduler.update_from_output = timed(engine.scheduler.update_from_output, "update_from_output", phases)
    engine.output_processor.process = timed(engine.output_processor.process, "output processing", phases)
    engine.step = timed(engine.step, "whole step", phases)

    rng = random.Random(0)
    vocab = engine.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100)
                                     for _ in range(rng.randint(args.input_len, args.input_len_max))]}
               for _ in range(args.num_prompts)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up, not counted
    seconds.clear()
    phases.clear()
    steps.clear()
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True))
    wall = time.perf_counter() - t
    print(f"{args.num_prompts} prompts ({args.input_len}-{args.input_len_max} tokens), {args.output_len} out: "
          f"{wall:.1f} s, {args.num_prompts * args.output_len / wall:.1f} output tok/s, {args.threads} threads")
    for step_kind in ("mixed", "decode"):
        rows = sorted(((s, n) for (k, n), s in seconds.items() if k == step_kind), reverse=True)
        print(f"\n{step_kind} steps:")
        for s, name in rows:
            print(f"  {s:9.3f} s  {name}")
    print("\nstep phases (ms per step):")
    for step_kind in ("mixed", "decode"):
        n = max(steps[step_kind], 1)
        cells = [f"{name} {1e3 * phases[(step_kind, name)] / n:.2f}" for name in
                 ("whole step", "schedule", "prepare_inputs", "model forward", "logits head", "sampler",
                  "update_from_output", "output processing")]
        print(f"  {step_kind} ({steps[step_kind]} steps): " + ", ".join(cells))


if __name__ == "__main__":
    main()

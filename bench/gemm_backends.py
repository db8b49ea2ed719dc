"""The CPU GEMM libraries side by side on the model's linear shapes: which one vbatch should use here.

    python bench/gemm_backends.py [--threads 2] [--rows 16,64,256,1024,2048,8192] [--dtypes float32] [--q8-0]

For each dtype and row count, every library kernels/gemm_libraries.py can run (oneDNN prepacked, MKL
through torch's F.linear, zentorch prepacked where its wheel loads, vbatch's own fp32 GEMM where the
native build has AVX2 and FMA, over fp32 panels and over the fp16 panels the avx2 tier packs from its
fp16-stored weights: "native-fp16") multiplies the same activations by the four linear weights of a
SmolLM2 layer ([960, 576] qkv, [576, 576] o_proj, [3072, 576] gate/up, [576, 1536] down), passes
alternating between the libraries, and prints GFLOP/s (the best of the passes: interference only
slows a pass down), each library's ratio to the fastest and, for
fp32, its share of the cores' multiply-add peak (cli/bench_ceilings.measure_fma_peak_gflops). The
engine picks one per dtype (`gemm_libraries.gemm_backend`, printed by `vbatch bench`; VBATCH_GEMM
overrides it): docs/performance/ records what this script measured on each CPU kind.
--q8-0 races, instead, the ways a Q8_0 model (`--quantization q8_0`) can multiply 5+ rows: oneDNN's fp32
GEMM over the dequantized weights ("float") and vbatch's integer GEMM (kernels/cpu_q8_0_linear.py:
"integer", and "integer-vnni" where the CPU has avx_vnni), as the layers the model builds; GFLOP/s
counts the same 2 x rows x out x in operations for each.
Run it in its own high-priority session on a shared machine (REFERENCE 8):
    setsid --wait bash -c 'echo -19 > /proc/$$/autogroup; exec nice -n -19 "$@"' _ python bench/gemm_backends.py
"""
from __future__ import annotations

import argparse
import functools
import time

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # [out, in] of one SmolLM2 layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="16,64,256,1024,2048,8192")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--q8-0", action="store_true", help="race the GEMMs of Q8_0 layers instead")
    args = ap.parse_args()

    import torch

    from vbatch.kernels import cpu_features, cpu_linear, gemm_libraries

    torch.set_num_threads(args.threads)
    cpu = cpu_features.detect()
    print(f"{cpu.model_name}; {cpu.deciding_flags}; {args.threads} threads; torch {torch.__version__}")
    from vbatch.cli.bench_ceilings import measure_fma_peak_gflops
    peak = measure_fma_peak_gflops(args.threads)  # fp32 GEMMs are held to it
    if peak is not None:
        print(f"fp32 multiply-add peak (registers only, the native {cpu_features.selected_tier().name} tier's "
              f"vectors): {peak:.0f} GFLOP/s")
    if args.q8_0:
        race_q8_0(args, cpu, peak)
        return
    available = [b for b in (gemm_libraries.backend_named(n) for n in gemm_libraries.BACKEND_NAMES) if b is not None]
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        if not gemm_libraries.can_pack(dtype):
            print(f"{dtype_name}: oneDNN has no fast path for it on this CPU (bf16 GEMMs run ~8x slower than fp32 "
                  "without avx512_bf16): skipped")
            continue
        chosen = gemm_libraries.gemm_backend(dtype).name
        backends = [b for b in available if dtype in b.dtypes]
        weights = [torch.randn(n, k).to(dtype) for n, k in SHAPES]
        packed = {b.name: [b.pack(w) for w in weights] for b in backends}
        linear = {b.name: b.linear for b in backends}
        for b in backends:   # the same GEMM over the narrower stored weights it takes as they are
            for stored in b.stored_dtypes:
                name = f"{b.name}-{str(stored).removeprefix('torch.').replace('float', 'fp')}"
                packed[name], linear[name] = [b.pack(w.to(stored)) for w in weights], b.linear
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in SHAPES}}
            runs = {name: [functools.partial(linear[name], xs[w.shape[1]], p, None, "none")
                           for w, p in zip(weights, packed[name])] for name in packed}
            report(f"{dtype_name} {rows:5d} rows", race(runs, args.passes), rows, peak if dtype == torch.float32 else None,
                   chosen)


def race(runs: dict, passes: int) -> dict[str, float]:
    """{name: [calls]} -> {name: best seconds of one pass over its calls}, the passes alternating."""
    import torch
    best = {name: float("inf") for name in runs}
    with torch.inference_mode():
        for calls in runs.values():  # warm-up: first calls pick kernels
            for call in calls:
                call()
        for _ in range(passes):
            for name, calls in runs.items():
                t = time.perf_counter()
                for call in calls:
                    call()
                best[name] = min(best[name], time.perf_counter() - t)
    return best


def report(label: str, best: dict[str, float], rows: int, peak: float | None, chosen: str) -> None:
    flops = sum(2 * rows * n * k for n, k in SHAPES)
    top = min(best.values())
    share = (lambda t: f", {flops / t / 1e9 / peak:.0%} of peak") if peak else (lambda t: "")
    cells = ", ".join(f"{name} {flops / t / 1e9:.0f} GFLOP/s ({top / t:.2f}{share(t)})" for name, t in best.items())
    print(f"{label}: {cells}; vbatch uses {chosen}")


def race_q8_0(args, cpu, peak) -> None:
    import torch

    from vbatch.kernels import cpu_linear, cpu_native, cpu_q8_0_linear
    native = cpu_native.load()
    if native is None or not native.has_gemm_q8_0:
        print("q8_0: this CPU's native build has no integer Q8_0 GEMM (cpu_gemm_q8.c needs AVX2 and FMA)")
        return
    linears = [torch.nn.Linear(k, n, bias=False) for n, k in SHAPES]
    layers = {"float": [cpu_linear.PackedLinear(lin, native=native, quantization="q8_0") for lin in linears],
              "integer": [cpu_q8_0_linear.PackedQ8_0Linear(lin, native=native, vnni=False) for lin in linears]}
    if cpu.has("avx_vnni"):
        layers["integer-vnni"] = [cpu_q8_0_linear.PackedQ8_0Linear(lin, native=native, vnni=True) for lin in linears]
    chosen = cpu_q8_0_linear.gemm_choice(native)
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in {k for _, k in SHAPES}}
        runs = {name: [functools.partial(layer, xs[layer.in_features]) for layer in group]
                for name, group in layers.items()}
        report(f"q8_0 {rows:5d} rows", race(runs, args.passes), rows, peak, chosen)

if __name__ == "__main__":
    main()

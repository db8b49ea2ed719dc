"""The CPU GEMM libraries side by side on the model's linear shapes: which one vbatch should use here.

    python bench/gemm_backends.py [--threads 2] [--rows 16,64,256,1024,2048,8192] [--dtypes float32]

For each dtype and row count, every library kernels/cpu_linear.py can run (oneDNN prepacked, MKL
through torch's F.linear, zentorch prepacked where its wheel loads, vbatch's own fp32 GEMM where the
native build has AVX2 and FMA) multiplies the same activations
by the four linear weights of a SmolLM2 layer ([960, 576] qkv, [576, 576] o_proj, [3072, 576]
gate/up, [576, 1536] down), passes alternating between the libraries, and prints GFLOP/s (the best
of the passes: interference only slows a pass down), each library's ratio to the fastest and, for
fp32, its share of the cores' multiply-add peak (cli/bench_ceilings.measure_fma_peak_gflops). The
engine picks one per dtype (`cpu_linear.gemm_backend`, printed by `vbatch bench`; VBATCH_GEMM
overrides it): docs/performance.md records what this script measured on each CPU kind.
Run it in its own high-priority session on a shared machine (REFERENCE 8):
    setsid --wait bash -c 'echo -19 > /proc/$$/autogroup; exec nice -n -19 "$@"' _ python bench/gemm_backends.py
"""
from __future__ import annotations

import argparse
import time

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # [out, in] of one SmolLM2 layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="16,64,256,1024,2048,8192")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--passes", type=int, default=7)
    args = ap.parse_args()

    import torch

    from vbatch.kernels import cpu_features, cpu_linear

    torch.set_num_threads(args.threads)
    cpu = cpu_features.detect()
    print(f"{cpu.model_name}; {cpu.deciding_flags}; {args.threads} threads; torch {torch.__version__}")
    from vbatch.cli.bench_ceilings import measure_fma_peak_gflops
    peak = measure_fma_peak_gflops(args.threads)  # fp32 GEMMs are held to it
    if peak is not None:
        print(f"fp32 multiply-add peak (registers only, the native {cpu_features.selected_tier().name} tier's "
              f"vectors): {peak:.0f} GFLOP/s")
    available = [b for b in (cpu_linear.backend_named(n) for n in cpu_linear.BACKEND_NAMES) if b is not None]
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        if not cpu_linear.can_pack(dtype):
            print(f"{dtype_name}: oneDNN has no fast path for it on this CPU (bf16 GEMMs run ~8x slower than fp32 "
                  "without avx512_bf16): skipped")
            continue
        chosen = cpu_linear.gemm_backend(dtype).name
        backends = [b for b in available if dtype in b.dtypes]
        weights = [torch.randn(n, k).to(dtype) for n, k in SHAPES]
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in SHAPES}}
            packed = {b.name: [b.pack(w) for w in weights] for b in backends}
            flops = sum(2 * rows * n * k for n, k in SHAPES)
            best = {b.name: float("inf") for b in backends}
            with torch.inference_mode():
                for b in backends:  # warm-up: first calls pick kernels
                    for w, p in zip(weights, packed[b.name]):
                        b.linear(xs[w.shape[1]], p, None, "none")
                for _ in range(args.passes):
                    for b in backends:
                        t = time.perf_counter()
                        for w, p in zip(weights, packed[b.name]):
                            b.linear(xs[w.shape[1]], p, None, "none")
                        best[b.name] = min(best[b.name], time.perf_counter() - t)
            top = min(best.values())
            share = (lambda t: f", {flops / t / 1e9 / peak:.0%} of peak") if peak and dtype == torch.float32 else (
                lambda t: "")
            cells = ", ".join(f"{name} {flops / t / 1e9:.0f} GFLOP/s ({top / t:.2f}{share(t)})"
                              for name, t in best.items())
            print(f"{dtype_name} {rows:5d} rows: {cells}; vbatch uses {chosen}")


if __name__ == "__main__":
    main()

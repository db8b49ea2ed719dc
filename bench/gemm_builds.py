"""vbatch's own GEMMs (cpu_gemm.c, cpu_gemm_q8.c) of this build against another build's, in one process.

    python bench/gemm_builds.py --against OTHER_BUILD [--kernel fp16|fp32|q8_0]
                                [--rows 16,64,256,2048] [--layers 30] [--rounds 9] [--threads 2] [--tier avx2]
    python bench/gemm_builds.py --kernel gated|gated-q8_0 [--rows ...]

Multiplies --layers layers' worth of SmolLM2-135M's four linear shapes ([960, 576] qkv, [576, 576]
o_proj, [3072, 576] gate/up, [576, 1536] down; random weights, each layer its own, so the weights
stream from memory as in a model step) by the same activations, through the entry point of
--kernel in this build and in --against's (another commit's build folder, $VBATCH_CACHE/kernels/<key>/,
built by running anything of that checkout once, or its library; it must take this build's
arguments), rounds alternating, and prints per row count each build's GFLOP/s (median round), the
median of the per-round time ratios and whether the outputs are identical. Without --against it
times this build alone. --kernel gated races this build's gated GEMM (silu(gate) * up in its
epilogue) against its plain GEMM over the same fp16 weights followed by the SiLU-and-mul op, on
the gate/up shape only; --kernel gated-q8_0 the same for the integer Q8_0 GEMM (cpu_gemm_q8.c
vb_gemm_q8_gated against vb_gemm_q8 + the op, Q8_0 of the same random weights, without AVX-VNNI);
the outputs must be equal bit for bit. The machine is noisy: this is the
way to compare two kernels (docs/performance/avx2-on-zen4.md, session 27). Run it in its own
high-priority session on a shared machine (REFERENCE 8):
    setsid --wait bash -c 'echo -19 > /proc/$$/autogroup; exec nice -n -19 "$@"' _ python bench/gemm_builds.py
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # [out, in] of one SmolLM2 layer
ENTRY = {"fp16": "vb_gemm_f16_f32", "fp32": "vb_gemm_f32", "q8_0": "vb_gemm_q8_f32"}
# the gated races: (the plain GEMM, its int arguments after k), (the gated GEMM, the same): fuse = 1; vnni = 0
GATED = {"gated": (("vb_gemm_f16_f32", ()), ("vb_gemm_gated_f16_f32", (1,))),
         "gated-q8_0": (("vb_gemm_q8_f32", (0,)), ("vb_gemm_q8_gated_f32", (0,)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=(*ENTRY, *GATED), default="fp16")
    ap.add_argument("--against", default=None, help="another build (its folder under $VBATCH_CACHE/kernels, or a library), timed alternately")
    ap.add_argument("--rows", default="16,64,256,2048")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tier", default=None, help="a native tier this CPU runs (default: its best)")
    args = ap.parse_args()

    import torch

    from vbatch.kernels import cpu_features, cpu_native, cpu_q8_0_linear, gemm_libraries, q8_0
    from vbatch.kernels.native_build import BASE_VARIANT, built_library

    tier = cpu_features.tier_named(args.tier) if args.tier else cpu_features.selected_tier()
    native = cpu_native.load(tier)
    if native is None or not native.has_gemm:
        raise SystemExit(f"the {tier.name} native build has no GEMM (cpu_gemm.c needs AVX2 and FMA)")
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    generator = torch.Generator().manual_seed(0)
    gated_kernel = args.kernel in GATED
    shapes = SHAPES[2:3] if gated_kernel else SHAPES

    def weights(n: int, k: int) -> torch.Tensor:
        w = torch.randn(n, k, generator=generator) * 0.05
        if args.kernel in ("q8_0", "gated-q8_0"):   # gated: the merged [gate; up] weight, as the model packs it
            return cpu_q8_0_linear.pack_panels(q8_0.quantize(w), k)
        if args.kernel == "gated":
            half = w.half()
            return torch.stack([gemm_libraries.pack_panels(half), gemm_libraries.pack_gated_panels(half[:n // 2],
                                                                                                    half[n // 2:])])
        return gemm_libraries.pack_panels(w.half() if args.kernel == "fp16" else w)

    layers = [[weights(n, k) for n, k in shapes] for _ in range(args.layers)]

    def bind(library: ctypes.CDLL, name: str, extra: int):
        fn = getattr(library, name)
        fn.argtypes, fn.restype = [p, i64, p, p, p, i64, i32, i32, i32, *[i32] * extra, i32], i32
        return fn

    if gated_kernel:
        (plain_name, plain_extra), (gated_name, gated_extra) = GATED[args.kernel]
        plain = bind(native.library(BASE_VARIANT), plain_name, len(plain_extra))
        gated = bind(native.library(BASE_VARIANT), gated_name, len(gated_extra))
        n, k = shapes[0]
        fp16 = args.kernel == "gated"   # fp16: [plain panels, gated pairs] stacked; Q8_0: one merged packing

        # each side allocates its outputs per call, as the engine's layers do (cpu_native.gemm_q8_0,
        # gemm_gated, silu_and_mul), and the op's result is kept as it is, not copied
        def gemm_then_op(x, ys):
            for i, (w,) in enumerate(layers):
                both = torch.empty(x.shape[0], n)
                assert plain(x.data_ptr(), k, (w[0] if fp16 else w).data_ptr(), None, both.data_ptr(), n,
                             x.shape[0], n, k, *plain_extra, args.threads) == 0
                ys[i] = native.silu_and_mul(both, args.threads)

        def one_gemm(x, ys):
            for i, (w,) in enumerate(layers):
                y = torch.empty(x.shape[0], n // 2)
                assert gated(x.data_ptr(), k, (w[1] if fp16 else w).data_ptr(), None, y.data_ptr(), n // 2,
                             x.shape[0], n // 2, k, *gated_extra, args.threads) == 0
                ys[i] = y

        builds = {"gated GEMM": one_gemm, "GEMM + op": gemm_then_op}
        out_width = [n // 2]
    else:
        libraries = {"this build": native.library(BASE_VARIANT)}
        if args.against:
            libraries["--against"] = ctypes.CDLL(str(built_library(Path(args.against), BASE_VARIANT)))
        extra = 1 if args.kernel == "q8_0" else 0
        fns = {label: bind(lib, ENTRY[args.kernel], extra) for label, lib in libraries.items()}

        def runner(fn):
            def run(x_by_shape, ys):
                for layer in layers:
                    for (n, k), w, x, y in zip(shapes, layer, x_by_shape, ys):
                        vnni = (0,) if extra else ()
                        assert fn(x.data_ptr(), k, w.data_ptr(), None, y.data_ptr(), n, x.shape[0], n, k, *vnni,
                                  args.threads) == 0
            return run

        builds = {label: runner(fn) for label, fn in fns.items()}
        out_width = [n for n, _ in shapes]

    print(f"{tier.name} build, {args.kernel} GEMM, {args.layers} layers of SmolLM2-135M's "
          f"{'gate/up' if gated_kernel else 'four linears'}, {args.threads} thread(s), "
          f"{args.rounds} alternating rounds")
    for m in map(int, args.rows.split(",")):
        xs = [torch.randn(m, k, generator=generator) for _, k in shapes]
        x_arg = xs[0] if gated_kernel else xs
        outs = {label: [torch.empty(m, w) for w in out_width] * (len(layers) if gated_kernel else 1)
                for label in builds}
        times: dict[str, list[float]] = {label: [] for label in builds}
        for label, run in builds.items():
            run(x_arg, outs[label])  # warm-up
        for r in range(args.rounds):
            for label in (list(builds) if r % 2 == 0 else list(builds)[::-1]):
                t = time.perf_counter()
                builds[label](x_arg, outs[label])
                times[label].append(time.perf_counter() - t)
        flops = args.layers * sum(2 * m * n * k for n, k in shapes)
        first = next(iter(builds))
        cells = [f"{label} {flops / statistics.median(ts) / 1e9:.1f} GFLOP/s" for label, ts in times.items()]
        line = f"{m:6d} rows: " + ", ".join(cells)
        if len(builds) == 2:
            other = list(builds)[1]
            ratio = statistics.median(b / a for a, b in zip(times[first], times[other]))
            same = all(torch.equal(a, b) for a, b in zip(outs[first], outs[other]))
            line += f"; {first} speed / {other}: median {ratio:.3f}x; outputs identical: {same}"
        print(line, flush=True)


if __name__ == "__main__":
    main()

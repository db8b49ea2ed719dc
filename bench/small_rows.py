"""The small-rows linear (decode at batch 1-4) over the model's weights as a decode step reads them.

    python bench/small_rows.py [--rows 1] [--dtype bfloat16] [--weights bfloat16|float16|float32|q8_0]
                               [--threads 2] [--passes 15] [--tier avx2] [--plain-pages]

Each pass runs `NativeKernels.linear_small` (kernels/csrc/cpu_linear_small.c) over a SmolLM2-135M's
linear weights in a decode step's order (30 x qkv [960, 576], o_proj [576, 576], gate/up [3072, 576],
down [576, 1536], then the head [49152, 576]: 269 MB in bf16, far more than the caches), so every
weight comes from memory, and from one huge-page arena, as in the engine (where the OS gives huge
pages; `--plain-pages`: 4 KiB pages, as before session 34), and prints the weight bytes read per
second (best and median of the passes). Compare it with the read ceiling (`python bench/ceilings.py`, the native read
probe at 1-8 streams per thread): docs/performance/ records what it measured per CPU kind.
--against LIB [LIB ...] races other builds of the kernel (their folders or libraries, e.g. this tree built
with VBATCH_NATIVE_CFLAGS="-DVB_F32_PREFETCH_FEW=0") against this one in the same process: --rounds
rounds, each a pass of every build (best of two, the order rotating) and the native read probe at 4
and 8 streams a thread over a 512 MiB huge-page buffer; it prints the medians and, per build, the
median of its per-round speed ratios to this build and to the probe. On a machine whose memory speed
moves within minutes, only such a race compares builds (docs/performance/avx2-on-zen4.md).
Run it in its own high-priority session on a shared machine (REFERENCE 8):
    setsid --wait bash -c 'echo -19 > /proc/$$/autogroup; exec nice -n -19 "$@"' _ python bench/small_rows.py
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # [out, in] of one SmolLM2 layer's linears
HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1, help="rows of x (1-8)")
    ap.add_argument("--dtype", default="bfloat16", help="activations: bfloat16 or float32")
    ap.add_argument("--weights", default=None, help="bfloat16 | float16 | float32 | q8_0 (default: --dtype)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=15)
    ap.add_argument("--tier", default=None, help="a lower native tier this CPU runs (default: its best)")
    ap.add_argument("--plain-pages", action="store_true",
                    help="leave the weights on 4 KiB pages (the engine puts them in one huge-page arena)")
    ap.add_argument("--against", nargs="+", default=[], metavar="LIB",
                    help="other builds (a build's folder under $VBATCH_CACHE/kernels, or a library), raced "
                         "against this one with the read probe")
    ap.add_argument("--rounds", type=int, default=60, help="rounds of the --against race")
    args = ap.parse_args()

    import torch

    from vbatch.kernels import cpu_features, cpu_huge_pages, cpu_native, q8_0

    torch.manual_seed(0)
    tier = cpu_features.tier_named(args.tier) if args.tier else cpu_features.selected_tier()
    native = cpu_native.load(tier)
    dtype = getattr(torch, args.dtype)
    weights_name = args.weights or args.dtype
    stored = torch.int8 if weights_name == "q8_0" else getattr(torch, weights_name)
    if native is None or not native.has_small_linear(dtype, stored):
        raise SystemExit(f"the {tier.name} tier has no small-rows kernel for {args.dtype} rows over "
                         f"{weights_name} weights")

    def weight(out: int, k: int) -> torch.Tensor:
        w = torch.randn(out, k) * 0.05
        return q8_0.quantize(w) if weights_name == "q8_0" else w.to(stored)

    shapes = [*LAYER * args.layers, HEAD]
    weights = [(weight(n, k), k) for n, k in shapes]
    # As the engine does (kernels/cpu_huge_pages.py): every weight in one arena advised for huge pages,
    # in the order a step reads them; 4 KiB pages cost a TLB miss every 4 KiB of the stream.
    holder = torch.nn.Module()
    for i, (w, _) in enumerate(weights):
        holder.register_buffer(f"w{i}", w)
    huge = not args.plain_pages and cpu_huge_pages.place_module(holder) > 0
    weights = [(getattr(holder, f"w{i}"), k) for i, (_, k) in enumerate(weights)]
    xs = {k: torch.randn(args.rows, k).to(dtype) for k in {k for _, k in shapes}}
    num_bytes = sum(w.numel() * w.element_size() for w, _ in weights)

    def one_pass() -> float:
        start = time.perf_counter()
        for w, k in weights:
            native.linear_small(xs[k], w, None, args.threads)
        return time.perf_counter() - start

    cpu = cpu_features.detect()
    if args.against:
        race(args, native, weights, xs, num_bytes, dtype, huge)
        return
    one_pass()  # warm-up: first calls load the library's entry points
    seconds = [one_pass() for _ in range(args.passes)]
    print(f"{cpu.model_name}; tier {tier.name}; {args.threads} threads; {args.rows} row(s) of {args.dtype} x "
          f"{weights_name} weights, {len(shapes)} matrices, {num_bytes / 1e6:.0f} MB on "
          f"{'huge' if huge else '4 KiB'} pages: best "
          f"{num_bytes / min(seconds) / 1e9:.1f} GB/s, median {num_bytes / statistics.median(seconds) / 1e9:.1f} GB/s "
          f"({statistics.median(seconds) * 1e3:.2f} ms a pass)")


def race(args, native, weights, xs, num_bytes, dtype, huge: bool) -> None:
    """--against: every build's pass and the read probe in turn, --rounds times (see the docstring)."""
    import torch

    from vbatch.kernels import cpu_huge_pages, cpu_native
    from vbatch.kernels.native_build import built_library, entry_suffix

    variant = entry_suffix(dtype)
    name = f"vb_linear_small_{variant}"
    this = native.function("vb_linear_small", dtype)
    builds = {"this build": this}
    for path in args.against:
        fn = getattr(ctypes.CDLL(str(built_library(Path(path), variant))), name, None)
        if fn is None:
            raise SystemExit(f"{path} has no {name}")
        fn.argtypes, fn.restype = this.argtypes, this.restype
        builds[path] = fn
    outs = {label: {n: torch.empty(args.rows, n, dtype=dtype) for n in {w.shape[0] for w, _ in weights}}
            for label in builds}   # each build's own outputs, compared at the end
    calls = {label: [(xs[k].data_ptr(), w.data_ptr(), cpu_native.WEIGHT_FORMAT[w.dtype], None,
                      outs[label][w.shape[0]].data_ptr(), args.rows, w.shape[0], k, args.threads) for w, k in weights]
             for label in builds}
    probe_holder = torch.nn.Module()
    probe_holder.register_buffer("words", torch.ones(128 << 20, dtype=torch.float32))   # 512 MiB
    if huge:   # as the weights
        cpu_huge_pages.place_module(probe_holder)
    words = probe_holder.words

    def gbps(label: str) -> float:
        fn = builds[label]
        start = time.perf_counter()
        for call in calls[label]:
            if fn(*call) != 0:
                raise SystemExit("the small-rows kernel refused the shape")
        return num_bytes / (time.perf_counter() - start) / 1e9

    def probe(streams: int) -> float:
        start = time.perf_counter()
        native.read_probe(words, streams, args.threads)
        return words.numel() * 4 / (time.perf_counter() - start) / 1e9

    for label in builds:
        gbps(label)   # warm-up
    seen = {label: [] for label in [*builds, "probe 4 streams", "probe 8 streams"]}
    labels = list(builds)
    for r in range(args.rounds):
        seen["probe 4 streams"].append(probe(4))
        seen["probe 8 streams"].append(probe(8))
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            seen[label].append(max(gbps(label), gbps(label)))
    print(f"{args.rows} row(s) of {args.dtype} x {args.weights or args.dtype} weights, {args.threads} threads, "
          f"{args.rounds} rounds alternating; GB/s of weights (medians):")
    for label, values in seen.items():
        line = f"  {label}: {statistics.median(values):.1f}"
        if label in builds:
            to_this = statistics.median(v / t for v, t in zip(values, seen["this build"]))
            to_probe = statistics.median(v / p for v, p in zip(values, seen["probe 8 streams"]))
            line += f", {to_this:.3f}x this build, {to_probe:.2f} of the 8-stream probe (per-round medians)"
        print(line)
    differ = max(float((outs[label][n].float() - outs["this build"][n].float()).abs().max())
                 for label in builds for n in outs[label])
    print(f"outputs differ by at most {differ:g}")


if __name__ == "__main__":
    main()

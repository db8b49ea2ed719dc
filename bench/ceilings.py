"""Measure this machine's GEMM rate and memory bandwidth and print the decode ceilings for a model.

    python bench/ceilings.py [--model smollm2-135m-instruct] [--threads 2] [--json FILE]

A thin script over `vbatch.cli.bench_ceilings` (the math and the measurements live there so
`vbatch bench throughput --ceilings` can use them too). `bench/peers.py` runs it once per
comparison, in its own high-priority session, and quotes the numbers in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", dest="json_file", default=None, help="also write the results here")
    args = parser.parse_args(argv)

    from transformers import AutoConfig

    from vbatch.cli.bench_ceilings import DECODE_SHAPE, ceilings_for, linear_params, measure_rates
    from vbatch.engine.models.resolve import resolve_model

    config = AutoConfig.from_pretrained(str(resolve_model(args.model, quiet=True).path))
    rates = measure_rates(args.threads)
    shape = linear_params(config)
    m, k, n = DECODE_SHAPE
    print(f"threads {rates.threads}; GEMM [{m}, {k}] x [{k}, {n}]: "
          + ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in rates.gemm_gflops.items())
          + f"; memory read {rates.read_gb_s:.1f} GB/s, copy {rates.copy_gb_s:.1f} GB/s")
    print(f"{args.model}: {shape.total / 1e6:.1f} M parameters in linear layers "
          f"({shape.num_layers} layers x {shape.per_layer / 1e6:.2f} M + lm_head {shape.lm_head / 1e6:.1f} M)")
    report = {"rates": rates.to_dict(), "linear_params": shape.total, "ceilings": {}}
    for dtype in rates.gemm_gflops:
        c = ceilings_for(config, dtype, rates)
        report["ceilings"][dtype] = c.to_dict()
        print(f"  {dtype}: large-batch decode <= {c.compute_tok_s:.0f} tok/s (compute), "
              f"batch-1 decode <= {c.bandwidth_tok_s:.0f} tok/s (bandwidth)")
    if args.json_file:
        with open(args.json_file, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

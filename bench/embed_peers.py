"""vbatch's embeddings against sentence-transformers' `encode`, same sentences, same threads, one run.

    python bench/embed_peers.py [--num-sentences 4000] [--repeats 3] [--threads 2]
                                [--st-batch-sizes 16,32,64,128] [--no-docs]

Needs sentence-transformers (`pip install -c constraints-cpu.txt sentence-transformers`); the model is
the catalogue's all-MiniLM-L6-v2 folder (inside its PyPI package). The sentences are real English
prose: the docstrings of Python's standard library split into sentences (deterministic for a
Python version), of natural lengths. Every repetition runs vbatch (`LLM.embed`, tokenisation
included) and sentence-transformers at each batch size (its length sorting included), alternating
in one process with the same torch thread count; medians of sentences/s, the ratio against
sentence-transformers' best setting, and the agreement of the two sets of embeddings (cosine) are
printed and written to docs/benchmarks.md (section "Embeddings").
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import re
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from peers_report import machine_facts, write_section  # noqa: E402

SECTION = "## Embeddings: vbatch (LLM.embed) vs sentence-transformers (encode)"
_MODULES = ("argparse", "collections", "json", "logging", "email", "http", "urllib", "asyncio", "unittest",
            "pathlib", "subprocess", "threading", "typing", "dataclasses", "functools", "itertools", "csv",
            "sqlite3", "xml", "zipfile", "tarfile", "datetime", "decimal", "fractions", "statistics",
            "random", "re", "string", "textwrap", "shutil", "tempfile", "socket", "ssl", "html", "inspect")


def say(msg: str) -> None:
    print(f"[embed-peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def corpus(n: int) -> list[str]:
    """Up to n distinct sentences of 4+ words from the standard library's docstrings, in a fixed order."""
    seen: dict[str, None] = {}
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        objs = [mod] + [obj for _, obj in sorted(vars(mod).items()) if inspect.isclass(obj) or inspect.isfunction(obj)]
        for obj in objs:
            doc = inspect.getdoc(obj) or ""
            for sent in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
                if 4 <= len(sent.split()) <= 120 and sent not in seen:
                    seen[sent] = None
                    if len(seen) >= n:
                        return list(seen)
    return list(seen)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-sentences", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--st-batch-sizes", default="16,32,64,128")
    ap.add_argument("--no-docs", action="store_true")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("sentence-transformers is not installed: pip install -c constraints-cpu.txt sentence-transformers",
              file=sys.stderr)
        return 2
    from vbatch import LLM
    from vbatch.engine.models.resolve import resolve_model
    from vbatch.kernels.cpu_features import detect

    sentences = corpus(args.num_sentences)
    words = [len(s.split()) for s in sentences]
    say(f"{len(sentences)} sentences, {statistics.mean(words):.1f} words on average (max {max(words)})")
    path = str(resolve_model("all-minilm-l6-v2").path)
    torch.set_num_threads(args.threads)
    llm = LLM(path, num_threads=args.threads, quiet=True)
    dtypes = ["float32"] + (["bfloat16"] if detect().has("avx512_bf16") else [])
    st_models = {}
    for dt in dtypes:
        m = SentenceTransformer(path, device="cpu")
        if dt == "bfloat16":
            m = m.to(torch.bfloat16)
        st_models[dt] = m
    batch_sizes = [int(b) for b in args.st_batch_sizes.split(",")]

    def run_vbatch():
        # truncate to the model's 256 tokens, as sentence-transformers does (vbatch refuses by default)
        return [o.outputs.embedding for o in llm.embed(sentences, truncate_prompt_tokens=-1)]

    def run_st(dt, bs):
        return st_models[dt].encode(sentences, batch_size=bs, normalize_embeddings=True, convert_to_numpy=True)

    systems = {"vbatch": run_vbatch}
    for dt in dtypes:
        for bs in batch_sizes:
            systems[f"sentence-transformers {dt} b{bs}"] = (lambda dt=dt, bs=bs: run_st(dt, bs))
    # warm-up, and agreement of the two implementations
    ours = torch.tensor(run_vbatch())
    theirs = torch.tensor(run_st("float32", batch_sizes[0]))
    cos = F.cosine_similarity(ours, theirs, dim=-1)
    say(f"agreement with sentence-transformers fp32: min cosine {float(cos.min()):.7f}")
    times: dict[str, list[float]] = {k: [] for k in systems}
    for rep in range(args.repeats):
        order = list(systems)
        order = order[rep % len(order):] + order[:rep % len(order)]
        for name in order:
            torch.set_num_threads(args.threads)
            t0 = time.perf_counter()
            systems[name]()
            dt = time.perf_counter() - t0
            times[name].append(dt)
            say(f"rep {rep + 1} {name}: {len(sentences) / dt:.1f} sentences/s")
    rate = {k: len(sentences) / statistics.median(v) for k, v in times.items()}
    best_peer = max((k for k in rate if k != "vbatch"), key=rate.get)
    ratio = rate["vbatch"] / rate[best_peer]
    lines = ["| system | sentences/s (median) | vbatch ÷ it |", "|---|---:|---:|"]
    for k in sorted(rate, key=rate.get, reverse=True):
        lines.append(f"| {k} | {rate[k]:.1f} | {rate['vbatch'] / rate[k]:.2f}x |")
    table = "\n".join(lines)
    print(table)
    print(f"vbatch / best sentence-transformers ({best_peer}): {ratio:.2f}x (target 1.5x)")
    if not args.no_docs:
        facts = machine_facts(REPO)
        body = (f"{SECTION}\n\nCommand: `python bench/embed_peers.py {' '.join(argv or sys.argv[1:])}`; commit "
                f"{facts['commit']}; {facts['date']}; {facts['cpu']} ({facts['isa']}), {args.threads} threads.\n"
                f"{len(sentences)} sentences of Python's stdlib docstrings ({statistics.mean(words):.1f} words on "
                f"average, max {max(words)}); all-MiniLM-L6-v2; {args.repeats} repetitions, systems alternating; "
                f"min cosine between the two sets of embeddings {float(cos.min()):.7f}.\n\n{table}\n\n"
                f"**vbatch ÷ best sentence-transformers ({best_peer}): {ratio:.2f}x** (target 1.5x).\n")
        write_section(REPO / "docs" / "benchmarks.md", SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

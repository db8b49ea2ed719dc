"""Bounded memory of `vbatch run` over a 200,000-line input (slow: about 20 s of CPU).

What is measured (docs/cli.md "Memory"): the whole pipeline (first validation pass, reader, runner
with its reorder window, JSONL writer) in a fresh subprocess, with the engine replaced by a trivial
TEST DOUBLE that answers every request with one token at its next step (200k real requests would
take too long on 2 cores; the real-model run over a few thousand lines is in test_run_real_model.py).
Peak RSS growth of the run is compared with the growth from merely holding the input's parsed
records in a list, which any load-everything implementation must at least pay. The only per-record
state the run keeps is the reader's id -> line map for duplicate-id detection (~150 bytes an id).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = r'''
import json, os, resource, sys
n, path = int(sys.argv[1]), sys.argv[2]
with open(path, "w") as f:
    for i in range(n):
        f.write(json.dumps({"id": f"q{i}", "prompt": f"Say {i}", "sampling_params": {"max_tokens": 1}}) + "\n")
from vbatch.engine.llm_engine import EngineStats
from vbatch.engine.output_stream import stream_outputs
from vbatch.engine.outputs import CompletionOutput, RequestOutput
from vbatch.engine.sampling_params import SamplingParams
from vbatch.batch.readers import open_reader

class Engine:  # test double: one token per request, no history kept
    def __init__(self): self.running = []
    def add_request(self, rid, prompt, params, pooling_task=None): self.running.append((rid, prompt))
    def has_unfinished_requests(self): return bool(self.running)
    def abort_request(self, rid): pass
    def step(self):
        done = [RequestOutput(request_id=rid, prompt=p.get("prompt"), prompt_token_ids=[1, 2], prompt_logprobs=None,
                              outputs=[CompletionOutput(index=0, text="x", token_ids=[7], cumulative_logprob=None,
                                                        logprobs=None, finish_reason="length")], finished=True)
                for rid, p in self.running]
        self.running = []
        return done

class LLM:  # test double of batch/jobs.BatchLLM over the real stream
    is_pooling_model = False
    def __init__(self): self.engine, self.stats = Engine(), EngineStats()
    def get_default_sampling_params(self): return SamplingParams()
    def stream(self, requests, **kw): return stream_outputs(self.engine, requests, **kw)

from vbatch.cli import run as run_cmd
from vbatch.cli.main import app
run_cmd.load_llm = lambda model, kwargs: LLM()
import threading, time
PAGE = os.sysconf("SC_PAGE_SIZE")
def current_rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE

class PeakSampler:  # ru_maxrss keeps earlier peaks (imports); sample the current RSS instead
    def __enter__(self):
        self.base = self.peak = current_rss()
        self.running = True
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()
        return self
    def loop(self):
        while self.running:
            self.peak = max(self.peak, current_rss())
            time.sleep(0.005)
    def __exit__(self, *a):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, current_rss())
        self.growth = self.peak - self.base

next(iter(open_reader(path)))  # warm the lazy imports
with PeakSampler() as run_mem:
    try:
        app(["run", path, "-o", path + ".out.jsonl", "--max-tokens", "1"], standalone_mode=False)
    except SystemExit:
        pass
run_growth = run_mem.growth
with open(path + ".out.jsonl") as f:
    num_out = sum(1 for _ in f)
with PeakSampler() as load_mem:
    held = list(open_reader(path))  # what "load everything" costs, before any output is held
load_growth = load_mem.growth
print(json.dumps({"run_growth": run_growth, "load_growth": load_growth, "num_out": num_out,
                  "input_bytes": os.path.getsize(path), "output_bytes": os.path.getsize(path + ".out.jsonl")}))
'''


@pytest.mark.slow
def test_200k_lines_run_in_bounded_memory(tmp_path):
    n = 200_000
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(n), str(tmp_path / "in.jsonl")], capture_output=True,
                          text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    print(m)
    assert m["num_out"] == n
    mib = 2**20
    # Input and output together are larger than the bound: the run cannot have held them.
    assert m["input_bytes"] + m["output_bytes"] > 80 * mib
    assert m["run_growth"] < 60 * mib
    # Merely holding the parsed input records costs more than the whole streaming run.
    assert m["load_growth"] > m["run_growth"]

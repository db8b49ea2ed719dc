"""`vbatch bench throughput`: the prompt builder, the ceiling napkin math, the result arithmetic,
and the command itself on a tiny real run. Nothing here asserts a speed."""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from vbatch.cli.bench_ceilings import (MachineRates, bandwidth_ceiling_tok_s, ceilings_for, compute_ceiling_tok_s,
                                       linear_params, measure_gemm_gflops)
from vbatch.cli.bench_dataset import LengthRange, build_prompts, parse_length_range, prompts_digest, special_token_ids
from vbatch.cli.bench_measure import LatencyResult, ThroughputResult
from vbatch.engine.errors import ConfigError

torch.set_num_threads(1)

# SmolLM2-135M's config.json fields (the default model)
SMOLLM2 = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                          intermediate_size=1536, num_hidden_layers=30, vocab_size=49152)


# ---------------------------------------------------------------- dataset
def test_parse_length_range():
    assert parse_length_range("256") == LengthRange(256, 256)
    assert parse_length_range("128-512") == LengthRange(128, 512)
    assert str(LengthRange(128, 512)) == "128-512" and str(LengthRange(7, 7)) == "7"
    for bad in ("abc", "512-128", "0", "1-2-3", ""):
        with pytest.raises(ConfigError):
            parse_length_range(bad)


def test_random_prompts_lengths_in_range_and_no_special_tokens():
    excluded = {0, 1, 2, 5, 99}
    prompts = build_prompts(num_prompts=300, input_len=LengthRange(3, 9), vocab_size=100, excluded_ids=excluded,
                            seed=7)
    assert len(prompts) == 300
    lengths = {len(p) for p in prompts}
    assert lengths == set(range(3, 10))  # 300 draws over 7 values: every length appears
    tokens = {t for p in prompts for t in p}
    assert not tokens & excluded
    assert tokens <= set(range(100))
    assert len(tokens) == 95  # 300 x ~6 draws cover every allowed id


def test_prompts_deterministic_by_seed():
    kw = dict(num_prompts=20, input_len=LengthRange(5, 50), vocab_size=1000, excluded_ids=[0])
    a, b, c = build_prompts(seed=3, **kw), build_prompts(seed=3, **kw), build_prompts(seed=4, **kw)
    assert a == b and a != c
    assert prompts_digest(a) == prompts_digest(b) != prompts_digest(c)


def test_fixed_dataset_uses_top_length():
    prompts = build_prompts(num_prompts=5, input_len=LengthRange(4, 11), vocab_size=50, excluded_ids=[],
                            seed=0, dataset="fixed")
    assert [len(p) for p in prompts] == [11] * 5
    assert len({tuple(p) for p in prompts}) == 5  # random ids: no shared prefixes to cache


def test_bad_dataset_and_count():
    with pytest.raises(ConfigError):
        build_prompts(num_prompts=1, input_len=LengthRange(1, 1), vocab_size=10, excluded_ids=[], seed=0,
                      dataset="sharegpt")
    with pytest.raises(ConfigError):
        build_prompts(num_prompts=0, input_len=LengthRange(1, 1), vocab_size=10, excluded_ids=[], seed=0)
    with pytest.raises(ConfigError):
        build_prompts(num_prompts=1, input_len=LengthRange(1, 1), vocab_size=2, excluded_ids=[0, 1], seed=0)


def test_special_token_ids_from_tokenizer_attributes():
    tok = SimpleNamespace(all_special_ids=[0, 2],
                          added_tokens_decoder={1: SimpleNamespace(content="<|im_start|>", special=True),
                                                7: SimpleNamespace(content="word", special=False)},
                          convert_tokens_to_ids=lambda toks: [{"<|im_start|>": 1, "word": 7}[t] for t in toks])
    assert special_token_ids(tok) == {0, 1, 2}


# ---------------------------------------------------------------- ceilings (hand-computed)
def test_linear_params_smollm2():
    shape = linear_params(SMOLLM2)
    # q 576x576, k and v 576x192, o 576x576, gate/up/down 576x1536
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    assert shape.per_layer == per_layer == 3_538_944
    assert shape.lm_head == 576 * 49152
    assert shape.total == 134_479_872  # the published 134.5M minus embedding-only and norm weights


def test_ceiling_math_known_numbers():
    n = 134_479_872
    # 900 GFLOP/s over 2 x 134.48 MFLOP per token
    assert compute_ceiling_tok_s(n, 900e9) == pytest.approx(900e9 / 268_959_744)
    assert compute_ceiling_tok_s(n, 900e9) == pytest.approx(3346.2, abs=0.1)
    # 70 GB/s over 269 MB of bf16 weights per token (REFERENCE 8: about 260 tok/s)
    assert bandwidth_ceiling_tok_s(n, 2, 70e9) == pytest.approx(260.3, abs=0.1)
    assert bandwidth_ceiling_tok_s(n, 4, 70e9) == pytest.approx(130.1, abs=0.1)
    rates = MachineRates(threads=2, gemm_gflops={"bfloat16": 900.0, "float32": 440.0}, read_gb_s=70.0,
                         copy_gb_s=60.0)
    c = ceilings_for(SMOLLM2, "bfloat16", rates)
    assert c.compute_tok_s == pytest.approx(3346.2, abs=0.1) and c.bandwidth_tok_s == pytest.approx(260.3, abs=0.1)
    c32 = ceilings_for(SMOLLM2, "float32", rates)
    assert c32.compute_tok_s == pytest.approx(440e9 / 268_959_744)


def test_measure_gemm_is_positive_on_a_tiny_shape():
    assert measure_gemm_gflops("float32", shape=(4, 8, 8), repeats=1) > 0


# ---------------------------------------------------------------- result arithmetic
def test_throughput_result_rates():
    r = ThroughputResult(num_requests=4, prompt_tokens=600, output_tokens=400, elapsed_s=2.0, prefill_phase_s=0.5,
                         decode_phase_s=1.5, decode_phase_tokens=300)
    d = r.to_dict()
    assert d["requests_per_s"] == 2.0 and d["total_tokens_per_s"] == 500.0 and d["output_tokens_per_s"] == 200.0
    assert d["decode_tokens_per_s"] == 200.0
    assert d["tokens_per_second"] == 500.0 and d["total_num_tokens"] == 1000  # vLLM's key names


def test_latency_result_median():
    r = LatencyResult(prompt_tokens=10, output_tokens=9, seconds=[3.0, 1.0, 2.0], decode_seconds=[1.0, 4.0, 2.0])
    assert r.median_s == 2.0 and r.output_tokens_per_s == 4.5 and r.decode_tokens_per_s == 4.0


# ---------------------------------------------------------------- the command (real model)
@pytest.mark.slow
def test_bench_throughput_cli_tiny_run(tmp_path):
    from vbatch.cli.main import app
    from vbatch.engine.models.resolve import resolve_model

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "throughput", "--num-prompts", "4", "--input-len", "16",
                                      "--output-len", "4", "--threads", "1", "--seed", "5", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "output tokens/s" in result.output
    report = json.loads(out.read_text())
    r = report["throughput"]
    assert r["num_requests"] == 4 and r["prompt_tokens"] == 64 and r["output_tokens"] == 16
    assert r["total_tokens"] == 80
    assert r["output_tokens_per_s"] == pytest.approx(16 / r["elapsed_s"])
    assert r["prefill_phase_s"] + r["decode_phase_s"] == pytest.approx(r["elapsed_s"])
    assert report["threads"] == 1 and report["dataset"] == "random" and report["input_len"] == "16"
    # the team over the run (engine/cpu_threads.py): one thread has nothing to give up
    assert report["thread_budget"] == "1 thread" and ", 1 thread," in result.output
    # what start-up compiled is reported (this CPU path: the native C kernels, or inductor without them)
    compiled = report["compile"]
    assert compiled["cuda_graphs_s"] is None
    if report["dtype"] == "bfloat16":  # exactly one of the two CPU bf16 paths ran
        seconds = [v for v in (compiled["native_kernels_s"], compiled["torch_compile_s"]) if v is not None]
        assert len(seconds) == 1 and 0 <= seconds[0] <= report["engine_build_s"]
    assert f"compiled at start-up (inside the build): {report['compile_description']}" in result.output
    # the same prompts a peer builds independently from the tokenizer and the seed
    folder = resolve_model("smollm2-135m-instruct", quiet=True).path
    added = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    specials = {t["id"] for t in added if t["special"]}
    assert specials == set(range(17))  # <|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, ...
    expected = build_prompts(num_prompts=4, input_len=LengthRange(16, 16), vocab_size=49152,
                             excluded_ids=specials, seed=5)
    assert report["prompts_digest"] == prompts_digest(expected)


@pytest.mark.slow
def test_bench_bad_flag_is_usage_error():
    from vbatch.cli.main import app

    result = CliRunner().invoke(app, ["bench", "throughput", "--input-len", "512-128"])
    assert result.exit_code == 2
    assert "--input-len" in result.output


def test_bench_max_model_len_too_short_is_usage_error():
    """Refused before any model load: an ignore_eos run must fit prompt + output."""
    from vbatch.cli.main import app

    result = CliRunner().invoke(app, ["bench", "throughput", "--input-len", "100", "--output-len", "50",
                                      "--max-model-len", "120"])
    assert result.exit_code == 2
    assert "--max-model-len" in result.output and "100 + 50" in result.output


# ---------------------------------------------------------------- bench/peers_report.py (a script beside the package)
def _bench_script(name: str):
    """bench/NAME.py, loaded as a module (the scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _peers_report():
    return _bench_script("peers_report")


def _record(system, variant, rep, out_tok_s, decode=None, lat_decode=None):
    tput = {"output_tokens_per_s": out_tok_s, "total_tokens_per_s": 3 * out_tok_s, "requests_per_s": 1.0,
            "elapsed_s": 10.0, "decode_tokens_per_s": decode}
    lat = {"median_s": 2.0, "output_tokens_per_s": 64.0, "decode_tokens_per_s": lat_decode}
    return {"system": system, "variant": variant, "tag": f"{system}-{variant}-r{rep}", "repeat": rep,
            "load": [["1.0 1.0 1.0", "1.1 1.0 1.0"]],
            "result": {"system": system, "version": "x", "dtype": "bfloat16", "throughput": tput, "latency": lat}}


def test_peers_timed_run_leaves_the_runs_own_cpu_time_out_of_others_load(tmp_path):
    # A run that keeps a core busy for 1 s: its own time is not other processes' load. The machine's
    # own load (another job beside the suite) is read over idle runs of the same length just before
    # and after, so the check is on what the busy run adds: nothing, where counting its own time
    # would add a whole core.
    peers = _bench_script("peers")
    busy = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass\n"
    idle = "import time\ntime.sleep(1.0)\n"

    def others(code: str) -> tuple[float, str]:
        rc, wall, before, after = peers.timed_run([sys.executable, "-c", code], [], dict(os.environ),
                                                  tmp_path / "run.log")
        assert rc == 0 and wall >= 1.0
        return float(after.split("(others busy: ")[1].split()[0]), after

    (quiet_before, _), (loaded, after), (quiet_after, _) = others(idle), others(busy), others(idle)
    assert loaded >= 0.0
    assert loaded < max(quiet_before, quiet_after) + 0.5, (after, quiet_before, quiet_after)


def test_peers_resume_reuses_the_finished_runs_and_refuses_another_spec(tmp_path, monkeypatch):
    # A run that dies after two of its four runs; --resume reruns only the other two (their tags file
    # names, the transformers batch/dtype variant included), and a different spec is refused.
    peers = _bench_script("peers")
    spec = {"cpu_kind": "avx2", "digest": "d1", "prompts": [[1, 2]], "gguf": None, "input_len": "2-2"}
    monkeypatch.setattr(peers, "build_spec", lambda args, workdir: dict(spec))
    monkeypatch.setattr(peers, "measure_ceilings", lambda *a: None)
    monkeypatch.setattr(peers, "probe_priority", lambda: [])
    monkeypatch.setattr(peers, "ensure_vllm_venv", lambda: None)
    reported, ran = [], []

    def run_one(system, variant, spec_, spec_path, workdir, tag, priority, vllm_python):
        assert "/" not in tag
        if len(ran) == 2 and not reported and crash[0]:
            raise KeyboardInterrupt  # killed mid-run
        ran.append(tag)
        return _record(system, variant, 0, 10.0 + len(ran))

    monkeypatch.setattr(peers, "run_one", run_one)
    monkeypatch.setattr(peers, "write_report", lambda records, *a: reported.append(records) or "")
    argv = ["--repeats", "1", "--systems", "vbatch,transformers", "--transformers-batch-sizes", "32,64",
            "--transformers-dtypes", "float32,bfloat16", "--workdir", str(tmp_path), "--no-docs"]
    crash = [True]
    with pytest.raises(KeyboardInterrupt):
        peers.main(argv)
    assert ran == ["vbatch-256-r0", "transformers-32-float32-r0"]
    crash[0] = False
    peers.main(argv + ["--resume"])
    assert ran[2:] == ["transformers-64-float32-r0", "transformers-32-bfloat16-r0", "transformers-64-bfloat16-r0"]
    assert [r["result"]["throughput"]["output_tokens_per_s"] for r in reported[0]] == [11.0, 12.0, 13.0, 14.0, 15.0]
    spec["digest"] = "d2"
    with pytest.raises(SystemExit, match="differs in digest"):
        peers.main(argv + ["--resume"])


def test_peers_report_medians_ratios_and_fractions(tmp_path):
    report = _peers_report()
    records = [_record("vbatch", "256", r, v, decode=d, lat_decode=90.0)
               for r, (v, d) in enumerate([(900.0, 1000.0), (1000.0, 1200.0), (1100.0, 1100.0)])]
    records[0]["result"]["cpu_gemm"] = "zentorch 9.9"
    records[0]["result"].update(engine_build_s=3.25, compile_description="native C kernels 0.1 s (reused build)")
    records += [_record("vllm", "256", r, v) for r, v in enumerate([500.0, 400.0, 600.0])]
    records += [_record("transformers", "32", r, 100.0) for r in range(3)]
    records += [_record("transformers", "64", r, 200.0) for r in range(3)]
    rows = {(r["system"], r["variant"]): r for r in report.summarise(records)}
    assert rows[("vbatch", "256")]["output_tok_s"] == 1000.0 and rows[("vbatch", "256")]["decode_tok_s"] == 1100.0
    assert rows[("vllm", "256")]["output_tok_s"] == 500.0
    ceilings = [{"rates": {"gemm_gflops": {"bfloat16": 500.0}, "read_gb_s": 30.0}, "linear_params": 100,
                 "ceilings": {"bfloat16": {"compute_tok_s": 2200.0, "bandwidth_tok_s": 100.0}}}]
    spec = {"model": "m", "prompts": [[1, 2]], "input_len": "2", "digest": "d", "latency_prompt": [1],
            "output_len": 4, "latency_iters": 1, "threads": 2}
    out = tmp_path / "b.md"
    text = report.write_report(records, ceilings, spec, SimpleNamespace(repeats=3), ["bench/peers.py"], out)
    assert text in out.read_text() and text.startswith("<!-- cpu-kind avx512-bf16 -->")   # this kind's section
    assert "vbatch ÷ vLLM CPU: **2.00x** (target ≥ 1.5x: met)" in text       # 1000 / 500
    assert "transformers (its best batch): **5.00x**" in text                 # 1000 / best(100, 200)
    assert "compute ceiling: **50%**" in text                                 # 1100 / 2200
    assert "bandwidth ceiling: **90%**" in text                               # 90 / 100
    assert "zentorch 9.9 (vbatch GEMMs)" in text                              # which GEMMs vbatch ran
    assert ("start-up, untimed (first run): vbatch: engine built in 3.2 s; compiled in it: native C kernels "
            "0.1 s (reused build)") in text


# ---------------------------------------------------------------- bench/op_times.py (a script beside the package)
def test_op_times_script_times_every_op_inside_the_step():
    # A tiny real run: the decode steps (2 requests: the native whole-layer call where this CPU path
    # has it, no nesting) list what ran, and their times cannot exceed the steps' total.
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "bench" / "op_times.py"
    done = subprocess.run([sys.executable, str(script), "--num-prompts", "2", "--input-len", "8", "--input-len-max",
                           "12", "--output-len", "3", "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    decode, phases = done.stdout.split("decode steps:")[1].split("step phases (ms per step):")
    times = {line.split(" s  ", 1)[1]: float(line.split(" s  ", 1)[0]) for line in decode.strip().splitlines()}
    total = times.pop("execute_model (all of the step's model work)")
    # the path's own pieces are timed: the whole-layer call and the packed head where the ops have them
    ops_line = next(line for line in done.stdout.splitlines() if line.startswith("ops "))
    assert ("decoder_layers" in times) == ("fused decoder layers on" in ops_line)
    assert ("linear logits_head" in times) == ("logits head packed" in ops_line)
    if "fused decoder layers on" not in ops_line:
        assert "paged_attention" in times and "linear qkv" in times  # the layers ran op by op
    assert 0 < sum(times.values()) <= total + 0.0005 * len(times)  # printed to the millisecond
    assert "linear qkv" in done.stdout.split("mixed steps:")[1]  # the prompt step runs the layers op by op
    # the phases table: per kind, the model's forward and logits head fit inside the whole step
    decode_phases = dict(cell.rsplit(" ", 1) for cell in phases.split("decode (")[1].split("): ")[1].split(", "))
    ms = {name: float(v) for name, v in decode_phases.items()}
    assert 0 < ms["model forward"] + ms["logits head"] + ms["sampler"] <= ms["whole step"] + 0.03


def test_peers_report_keeps_a_section_per_cpu_kind_with_its_targets(tmp_path):
    # An AVX2 run: its own targets (transformers 3x at its best batch and dtype, llama.cpp 1.5x at
    # its best batching, batch-1 vs llama.cpp, bandwidth at the 2-byte weights vbatch streams), and
    # the AVX-512 section written before stays as it was.
    report = _peers_report()
    out = tmp_path / "b.md"
    spec = {"model": "m", "prompts": [[1, 2]], "input_len": "2", "digest": "d", "latency_prompt": [1],
            "output_len": 4, "latency_iters": 1, "threads": 2}
    ceilings = [{"rates": {"gemm_gflops": {"float32": 150.0, "bfloat16": 19.0}, "read_gb_s": 23.0},
                 "linear_params": 100, "ceilings": {"float32": {"compute_tok_s": 700.0, "bandwidth_tok_s": 40.0},
                                                    "bfloat16": {"compute_tok_s": 90.0, "bandwidth_tok_s": 80.0}}}]
    zen4 = [_record("vbatch", "256", 0, 300.0)]
    # another script's section written first (a new file), then the kinds' sections: it stays, after them
    report.write_section(out, "## Embeddings: a section of another script", "## Embeddings: a section of another "
                         "script\n\nits table\n")
    report.write_report(zen4, ceilings, spec | {"cpu_kind": "avx512-bf16"}, SimpleNamespace(repeats=1), ["p"], out)
    first = out.read_text()
    assert first.startswith("# Benchmarks: vbatch and its peers") and first.count("# Benchmarks") == 1
    assert first.index("## Measuring vbatch alone") < first.index("## Embeddings: a section")
    vb = _record("vbatch", "256", 0, 130.0, decode=250.0, lat_decode=60.0)
    vb["result"].update(dtype="float32", weight_dtype="float16", kv_cache_dtype="float16")
    vb["result"]["latency"]["output_tokens_per_s"] = 62.0
    # what `vbatch bench --latency --ceilings` adds: its own read probe, right after the timed runs
    vb["result"]["ceilings"] = {"read_gb_s": 19.5, "decode_fraction_of_bandwidth": 0.88}
    records = [vb, _record("transformers", "32/float32", 0, 40.0), _record("transformers", "32/bfloat16", 0, 10.0),
               _record("vbatch-q8_0", "256", 0, 110.0), _record("llamacpp", "1", 0, 43.0), _record("llamacpp", "32", 0, 80.0)]
    records[-2]["result"]["latency"]["output_tokens_per_s"] = 62.0
    records[-1]["result"]["latency"] = None
    text = report.write_report(records, ceilings, spec | {"cpu_kind": "avx2", "cpu_flags": "avx2 fma f16c, no avx512_bf16"},
                               SimpleNamespace(repeats=1), ["p"], out)
    whole = out.read_text()
    zen4_section = first.split("<!-- cpu-kind avx512-bf16 -->")[1].split("<!-- /cpu-kind avx512-bf16 -->")[0]
    assert zen4_section in whole and text in whole and whole.index(zen4_section) < whole.index(text)
    assert "CPU flags that chose the path: avx2 fma f16c, no avx512_bf16" in text
    assert "(its best batch and dtype): **3.25x** (target ≥ 3.0x: met)" in text   # 130 / 40 (fp32, not bf16)
    assert "q8_0 (optional int8 weights) ÷ transformers: **2.75x** (target ≥ 3.0x: not met)" in text  # 110 / 40
    assert "llama.cpp (its best batching): **1.62x** (target ≥ 1.5x: met)" in text  # 130 / 80
    assert "batch-1 output tok/s, vbatch ÷ llama.cpp: **1.00x**" in text            # 62 / 62
    assert "bandwidth ceiling (the bytes vbatch reads: its weight storage): **75%**" in text  # 60 / 80 (2-byte)
    assert "(target ≥ 70%: met); against the probe of the same minute: 88%" in text
    assert "ran right after its timed runs (`--latency --ceilings`; median over the repetitions): 19.5 GB/s" in text
    assert "| float32 (float16 weights, float16 KV) |" in text and "| 32 sequences batched |" in text
    # An AVX-512 machine whose bf16 GEMMs run on AMX is a kind of its own: a third section, the
    # AVX-512 targets, the tier it ran named in its title; the other two kept.
    amx = report.write_report(zen4, ceilings, spec | {"cpu_kind": "avx512-bf16-amx", "cpu_tier": "avx512-bf16"},
                              SimpleNamespace(repeats=1), ["p"], out)
    assert amx.startswith("<!-- cpu-kind avx512-bf16-amx -->\n## AVX-512 with avx512_bf16 and AMX: ")
    assert "(tier `avx512-bf16`)" in amx and "vbatch ÷ vLLM CPU" in amx
    final = out.read_text()
    assert zen4_section in final and text in final and amx in final
    assert final.index(zen4_section) < final.index(amx) < final.index(text) < final.index("## Measuring vbatch")
    assert final.endswith("## Embeddings: a section of another script\n\nits table\n")
    # The avx2 tier forced on that AMX machine (its libraries held to AVX2) is a fourth kind: it must
    # not replace the AVX2 machine's section; it gets the AVX2 targets and says what was held.
    held = report.write_report(records, ceilings, spec | {
        "cpu_kind": "avx2-on-avx512-bf16-amx", "cpu_tier": "avx2",
        "isa_hold": "VBATCH_CPU_TIER=avx2 ATEN_CPU_CAPABILITY=avx2"}, SimpleNamespace(repeats=1), ["p"], out)
    assert held.startswith("<!-- cpu-kind avx2-on-avx512-bf16-amx -->\n## AVX2 + FMA + F16C, no AVX-512 kernels, "
                           "forced on a CPU of kind AVX-512 with avx512_bf16 and AMX: ")
    assert "Instruction sets held for every system: VBATCH_CPU_TIER=avx2 ATEN_CPU_CAPABILITY=avx2." in held
    assert "(its best batch and dtype): **3.25x** (target ≥ 3.0x: met)" in held
    last = out.read_text()
    assert text in last and amx in last and zen4_section in last and held in last
    # An Intel AVX-512 CPU without avx512_bf16 (the avx512 tier) is a kind of its own, with the
    # fp32 CPUs' targets (the same records: the same ratios); the four sections before it stay.
    cascade = report.write_report(records, ceilings, spec | {"cpu_kind": "avx512", "cpu_tier": "avx512"},
                                  SimpleNamespace(repeats=1), ["p"], out)
    assert cascade.startswith("<!-- cpu-kind avx512 -->\n## AVX-512 without avx512_bf16: ")
    assert "(its best batch and dtype): **3.25x** (target ≥ 3.0x: met)" in cascade
    assert all(section in out.read_text() for section in (text, amx, zen4_section, held, cascade))
    # Zen 5 (full-width AVX-512: cpu_features.machine_kind) does not replace Zen 4's section; it has
    # the avx512-bf16 targets, and the avx2 tier forced there is filed apart from both
    zen5 = report.write_report(zen4, ceilings, spec | {"cpu_kind": "avx512-bf16-zen5", "cpu_tier": "avx512-bf16"},
                               SimpleNamespace(repeats=1), ["p"], out)
    assert zen5.startswith("<!-- cpu-kind avx512-bf16-zen5 -->\n## AVX-512 with avx512_bf16 at full width "
                           "(AMD Zen 5): ")
    assert "vbatch ÷ vLLM CPU" in zen5 and "(its best batch): " in zen5
    on_zen5 = report.write_report(records, ceilings, spec | {"cpu_kind": "avx2-on-avx512-bf16-zen5", "cpu_tier": "avx2"},
                                  SimpleNamespace(repeats=1), ["p"], out)
    assert "forced on a CPU of kind AVX-512 with avx512_bf16 at full width (AMD Zen 5): " in on_zen5
    assert "(its best batch and dtype): **3.25x** (target ≥ 3.0x: met)" in on_zen5
    assert all(section in out.read_text() for section in (text, amx, zen4_section, held, cascade, zen5, on_zen5))
    # Notes written by hand after a kind's section stay after it when that kind or another is rerun.
    note = "### The AVX-512 machine's vLLM run\n\nwritten by hand"
    out.write_text(out.read_text().replace("<!-- /cpu-kind avx512-bf16 -->", "<!-- /cpu-kind avx512-bf16 -->\n\n" + note))
    report.write_report(zen4, ceilings, spec | {"cpu_kind": "avx512-bf16"}, SimpleNamespace(repeats=1), ["p"], out)
    report.write_report(records, ceilings, spec | {"cpu_kind": "avx2"}, SimpleNamespace(repeats=1), ["p"], out)
    kept = out.read_text()
    assert kept.count(note) == 1 and f"<!-- /cpu-kind avx512-bf16 -->\n\n{note}\n\n<!-- cpu-kind " in kept
    assert all(section in kept for section in (amx, held, cascade))


def test_peers_report_ceilings_are_the_best_measurement():
    # Ceilings before and after the runs: the larger rate counts (interference only lowers one),
    # and a measurement without a bf16 GEMM rate is skipped, not a crash.
    report = _peers_report()
    rows = report.summarise([_record("vbatch", "256", 0, 100.0, decode=600.0, lat_decode=50.0)])
    ceilings = [{"rates": {"gemm_gflops": {"bfloat16": 400.0}, "read_gb_s": 20.0}, "linear_params": 100,
                 "ceilings": {"bfloat16": {"compute_tok_s": 1000.0, "bandwidth_tok_s": 80.0}}},
                {"rates": {"gemm_gflops": {}, "read_gb_s": 25.0}, "linear_params": 100,
                 "ceilings": {"bfloat16": {"compute_tok_s": 1200.0, "bandwidth_tok_s": 100.0}}}]
    lines, fractions = report._ceiling_lines(rows, ceilings)
    assert "400 GFLOP/s; memory read 25.0 GB/s" in lines[0]
    assert fractions == {"compute": 0.5, "bandwidth": 0.5}                   # 600 / 1200, 50 / 100


def test_compile_times_describe_each_kind():
    from vbatch.engine.compile_times import CompileTimes
    assert CompileTimes().describe() == "nothing compiled (reference ops)"
    assert CompileTimes(native_kernels_s=1.25, native_kernels_compiled=True).describe() == \
        "native C kernels 1.2 s (compiled now)"
    both = CompileTimes(torch_compile_s=11.0, cuda_graphs_s=4.5)
    assert both.describe() == "torch.compile warm-up 11.0 s, CUDA graph capture 4.5 s"
    assert both.to_dict() == {"native_kernels_s": None, "native_kernels_compiled": None,
                              "torch_compile_s": 11.0, "cuda_graphs_s": 4.5}


def test_native_compile_is_reported_only_by_the_start_up_that_did_it():
    # The kernels load once per process: an engine started after they loaded (after another engine,
    # a test, a benchmark script) compiled nothing, so its build must not claim their compile.
    from vbatch.engine.compile_times import CompileTimes, native_load
    from vbatch.kernels.cpu_native import NativeKernels, NativeLoad
    native = NativeKernels(None)
    native._loads.extend([NativeLoad(done_at=100.0, seconds=13.0, compiled=True),      # the first engine's
                          NativeLoad(done_at=130.0, seconds=0.25, compiled=False)])    # a variant found built
    assert native_load(None, 50.0) == {"native_kernels_s": None, "native_kernels_compiled": None}
    assert native_load(native, 99.5) == {"native_kernels_s": 13.25, "native_kernels_compiled": True}  # loaded in it
    assert native_load(native, 125.0) == {"native_kernels_s": 0.25, "native_kernels_compiled": False}
    later = native_load(native, 140.0)
    assert later == {"native_kernels_s": 0.0, "native_kernels_compiled": False}
    assert CompileTimes(**later).describe() == "native C kernels 0.0 s (reused build)"


def test_commits_script_refuses_a_commit_it_does_not_know():
    # bench/commits.py installs the other commit before any run: a bad name stops it at once, named.
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "bench" / "commits.py"
    done = subprocess.run([sys.executable, str(script), "--against", "no-such-commit-here"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--against no-such-commit-here: not a commit of this repository" in done.stderr


def test_commits_table_gives_medians_and_each_pairs_ratio():
    # Hand-computed: medians 110 and 100 -> 1.100x; pairs 90/100, 110/100, 120/100.
    commits = _bench_script("commits")
    reports = {"this checkout": [{"throughput": {"output_tokens_per_s": v, "prefill_phase_s": 3.0, "decode_phase_s": 2.0}}
                                 for v in (90.0, 110.0, 120.0)],
               "388b602": [{"throughput": {"output_tokens_per_s": 100.0, "prefill_phase_s": 3.5, "decode_phase_s": 2.5}}
                           for _ in range(3)]}
    text = commits.table("throughput", reports)
    assert "| this checkout | 90.0, 110.0, 120.0 | 3.0, 3.0, 3.0 | 2.0, 2.0, 2.0 | 110.0 |" in text
    assert "this checkout ÷ 388b602: **1.100x** (medians; pair by pair 0.900, 1.100, 1.200)" in text
    latency = {name: [{"latency": {"output_tokens_per_s": r["throughput"]["output_tokens_per_s"]}} for r in runs]
               for name, runs in reports.items()}
    assert "| 388b602 | 100.0, 100.0, 100.0 | - | - | 100.0 |" in commits.table("batch 1", latency)


@pytest.mark.slow
def test_contention_script_runs_two_processes_at_once(tmp_path):
    # --shards: two real `vbatch bench throughput` processes started together, teams fixed then
    # adapting; each gets its row with both processes' rates and the wall time.
    import subprocess
    import sys
    from pathlib import Path
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("bench/contention.py needs two CPUs")
    script = Path(__file__).resolve().parents[1] / "bench" / "contention.py"
    done = subprocess.run([sys.executable, str(script), "--shards", "--num-prompts", "2", "--input-len", "16-32",
                           "--output-len", "4", "--repeats", "1", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("| two processes")}
    assert set(rows) == {"two processes, teams fixed", "two processes, teams adapt"}, done.stdout
    for line in rows.values():
        rates = [float(v) for v in line.split("|")[6].split(",")]
        assert len(rates) == 2 and min(rates) > 0, line
    assert "teams adapting / fixed" in done.stdout and len(list(tmp_path.glob("shards-*.json"))) == 4



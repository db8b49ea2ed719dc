"""IO processor plugins: discovery through a real entry point (a third-party plugin pip-installed from
tests/plugins/), the choice rule, the error listing installed plugins, and the plugin driver
(pure Python through a fake model runner; the installed plugin on the real all-MiniLM-L6-v2)."""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_pooling_engine import FakePoolingRunner, make_engine  # noqa: E402  (tests/ is on sys.path)
from vbatch.engine.errors import InputError
from vbatch.engine.pooling_params import PoolingParams
from vbatch.io_plugins.driver import PluginInput, run_plugin
from vbatch.io_plugins.interface import IOProcessor, PluginConfig, PluginContext
from vbatch.io_plugins.registry import PluginError, installed_plugins, load_plugin_class, select_plugin

PLUGIN_SRC = Path(__file__).parent / "plugins" / "vbatch_pair_plugin"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """pip-installs the test plugin into a fresh folder (no deps, no build isolation: offline-safe)."""
    target = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(PLUGIN_SRC)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert any(p.name.startswith("vbatch_pair_plugin") and p.name.endswith(".dist-info") for p in target.iterdir())
    return target


@pytest.fixture
def on_path(installed, monkeypatch):
    monkeypatch.syspath_prepend(str(installed))
    return installed


def test_a_third_party_plugin_is_found_through_its_entry_point(on_path):
    assert "pair" in installed_plugins()
    cls = load_plugin_class("pair")
    assert issubclass(cls, IOProcessor) and cls.__name__ == "PairSimilarity"


def test_an_unknown_plugin_lists_the_installed_ones(on_path):
    with pytest.raises(PluginError, match=r"no IO processor plugin named 'nope'; installed: .*pair"):
        load_plugin_class("nope")


def test_without_the_distribution_the_plugin_is_not_there():
    assert "pair" not in installed_plugins()


def test_the_explicit_name_wins_over_the_model_config():
    class Cfg:
        io_processor_plugin = "from-config"
    assert select_plugin("explicit", Cfg()) == "explicit"
    assert select_plugin(None, Cfg()) == "from-config"
    assert select_plugin(None, object()) is None and select_plugin(None, None) is None


def test_the_installed_plugin_runs_on_the_real_model_from_the_config_key(on_path, minilm_path, tmp_path):
    from vbatch import LLM
    folder = tmp_path / "minilm-with-plugin"
    shutil.copytree(minilm_path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "io_processor_plugin": "pair"}))
    llm = LLM(str(folder), quiet=True)
    assert type(llm.io_processor).__name__ == "PairSimilarity"
    outs = llm.encode([{"a": "A man is eating food.", "b": "A man is eating a piece of bread."},
                       {"a": "A man is eating food.", "b": "A man is eating food."}])
    assert round(outs[0].outputs["cosine"], 4) == 0.7553 and abs(outs[1].outputs["cosine"] - 1) < 1e-5
    with pytest.raises(InputError, match="input 0: parse_data: data: needs"):
        llm.encode({"a": "only one"})
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(PluginError, match="no IO processor plugin named 'missing'"):
        LLM(str(folder), io_processor_plugin="missing", quiet=True)


def test_vbatch_encode_runs_a_third_party_plugin_over_a_request_file(on_path, minilm_path, tmp_path):
    """The CLI is generic over plugins: a .jsonl of the plugin's own records, one result line each."""
    from typer.testing import CliRunner

    from vbatch.cli.main import app
    lines = [{"a": "A man is eating food.", "b": "A man is eating a piece of bread.", "request_id": "p1"},
             {"a": "only one"}]
    req = tmp_path / "pairs.jsonl"
    req.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = CliRunner().invoke(app, ["encode", "--plugin", "pair", "--model", str(minilm_path), str(req), "-o",
                                 str(tmp_path / "out")])
    assert r.exit_code == 1, r.output
    got = [json.loads(x) for x in (tmp_path / "out" / "pairs.jsonl").read_text().splitlines()]
    assert got[0]["request_id"] == "p1" and round(got[0]["cosine"], 4) == 0.7553 and got[0]["error"] is None
    assert "needs {'a': text, 'b': text}" in got[1]["error"]
    r = CliRunner().invoke(app, ["encode", "--plugin", "pair", "--model", str(minilm_path), str(tmp_path),
                                 "-o", str(tmp_path / "o2")])
    assert r.exit_code == 2 and "names no input files to look for in folders" in r.output


# ---------------------------------------------------------------------------- the driver, pure Python
class Tiles(IOProcessor):
    """Test plugin: an input {"n": k} becomes k one-token prompts (lazily); the output is their sums.

    Records what it sees, to check the driver's bounds; keeps no per-input state on self."""

    def __init__(self, config=None, fail=()):
        super().__init__(config or PluginConfig(model="fake"))
        self.fail = set(fail)
        self.log: list[tuple[str, str]] = []

    def parse_data(self, data):
        if "parse" in self.fail and data.get("bad") == "parse":
            raise InputError("not a tile", field="data")
        return data

    def merge_pooling_params(self, params=None):
        return params or PoolingParams(task="embed")

    def pre_process(self, prompt, request_id=None, *, context=None, **kwargs):
        context.state["n"] = prompt["n"]
        self.log.append(("pre", request_id))

        def prompts():
            for k in range(prompt["n"]):
                if prompt.get("bad") == "midway" and k == 2:
                    raise OSError("truncated file")
                yield {"prompt_token_ids": [prompt.get("base", 1) + k]}
        return prompts()

    def post_process(self, model_output, request_id=None, *, context=None, **kwargs):
        self.log.append(("post", request_id))
        if context.state.get("n") == 99:
            raise ValueError("cannot write")
        return [float(o.outputs.data[0]) for o in model_output]


class Served:
    def __init__(self, engine):
        self.engine = engine

    def stream(self, requests, **kw):
        return self.engine.stream(requests, **kw)


def test_the_driver_shares_batches_and_posts_each_input_when_its_last_request_is_done():
    runner = FakePoolingRunner()
    llm = Served(make_engine(runner, max_num_seqs=4, budget=100))
    plugin = Tiles()
    inputs = [PluginInput(f"f{i}", {"n": n, "base": 10 * i}) for i, n in enumerate((3, 1, 5, 2))]
    results = {r.key: r for r in run_plugin(llm, plugin, inputs, max_in_flight=4)}
    assert {k: r.output for k, r in results.items()} == {
        "f0": [0.0, 1.0, 2.0], "f1": [10.0], "f2": [20.0, 21.0, 22.0, 23.0, 24.0], "f3": [30.0, 31.0]}
    assert results["f2"].num_requests == 5
    assert any(len({rid.split(".")[0] for rid in step}) > 1 for step in runner.steps)   # inputs share steps
    assert max(len(s) for s in runner.steps) <= 4


def test_open_inputs_are_bounded_but_a_big_input_streams_all_its_prompts():
    plugin = Tiles()
    llm = Served(make_engine(max_num_seqs=8, budget=100))
    inputs = [PluginInput(f"f{i}", {"n": 20 if i == 0 else 1}) for i in range(6)]
    results = list(run_plugin(llm, plugin, inputs, max_in_flight=8, max_open_inputs=2))
    assert len(results) == 6 and all(r.ok for r in results)
    open_now, most = set(), 0
    for stage, rid in plugin.log:                      # pre/post in call order
        (open_now.add if stage == "pre" else open_now.discard)(rid)
        most = max(most, len(open_now))
    assert most <= 2


def test_each_stage_failure_is_that_inputs_error_and_the_rest_go_on():
    plugin = Tiles(fail={"parse"})
    engine = make_engine(max_num_seqs=4, budget=100)
    inputs = [PluginInput("ok", {"n": 2}), PluginInput("parse", {"n": 2, "bad": "parse"}),
              PluginInput("midway", {"n": 5, "bad": "midway"}), PluginInput("post", {"n": 99}),
              PluginInput("none", {"n": 0}), PluginInput("long", {"n": 1, "base": 10**9}), PluginInput("ok2", {"n": 1})]
    results = {r.key: r for r in run_plugin(Served(engine), plugin, inputs)}
    assert results["ok"].output == [1.0, 2.0] and results["ok2"].output == [1.0]   # token ids 1, 2 (no base)
    assert results["parse"].error == "parse_data: data: not a tile"
    assert results["midway"].error == "pre_process: OSError: truncated file" and results["midway"].num_requests == 2
    assert results["post"].error == "post_process: ValueError: cannot write"
    assert results["none"].error == "pre_process: gave no prompts"
    assert results["long"].error.startswith("request 0: ") and "vocabulary" in results["long"].error
    assert not engine.has_unfinished_requests()


def test_post_process_async_sorts_outputs_by_index():
    class Echo(Tiles):
        def post_process(self, model_output, request_id=None, *, context=None, **kwargs):
            return list(model_output)

    async def outputs():
        for i in (2, 0, 1):
            yield i, f"out{i}"
    got = asyncio.run(Echo().post_process_async(outputs(), "r", context=PluginContext("r")))
    assert got == ["out0", "out1", "out2"]

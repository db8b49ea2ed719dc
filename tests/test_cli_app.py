"""The `vbatch` app frame: help/version as a subprocess (and without torch), the error handler, exit codes."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
import sys

import pytest
import typer
from typer.testing import CliRunner

from vbatch import __version__
from vbatch.cli import errors as cli_errors
from vbatch.cli.main import app
from vbatch.engine.errors import ConfigError, InputError, ModelLoadError

runner = CliRunner()


def run_py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_help_in_a_subprocess_lists_commands_and_exit_codes_without_torch():
    code = ("import sys\nfrom vbatch.cli.main import main\nsys.argv = ['vbatch', '--help']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
            "heavy = [m for m in ('torch', 'transformers', 'pyarrow') if m in sys.modules]\n"
            "print('HEAVY', heavy, 'CODE', code)")
    proc = run_py(code)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # Rich wraps the epilog at the terminal width
    for word in ("run", "validate", "merge", "models", "Exit codes", "130 interrupted", "143 terminated"):
        assert word in text
    assert "HEAVY [] CODE 0" in proc.stdout


def test_console_script_version():
    proc = subprocess.run([sys.executable, "-m", "vbatch.cli.main", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"vbatch {__version__}"


def test_run_from_the_checkout_root_does_not_shadow_the_pypi_kernels_package():
    # `python -m vbatch...` from the checkout's root puts the root on sys.path, where the folder
    # kernels/ would be the top-level module `kernels` that transformers (>= 5.25) imports from PyPI
    # when it loads a model's config. Importing vbatch takes the root off the path again.
    root = Path(__file__).resolve().parents[1]
    code = ("import importlib.util, os, sys; import vbatch; spec = importlib.util.find_spec('kernels'); "
            "print(any(os.path.abspath(p or '.') == os.getcwd() for p in sys.path), "
            "spec is not None and os.path.dirname(os.path.abspath(spec.origin or '')) == os.path.join(os.getcwd(), 'kernels'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]
    load = "import vbatch; from transformers import AutoConfig; AutoConfig.for_model('llama'); print('ok')"
    proc = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_command_help_has_vllm_flag_names():
    result = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert result.exit_code == 0
    for flag in ("--model", "--dtype", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                 "--kv-cache-memory", "--enable-prefix-caching", "--seed", "--generation-config",
                 "--chat-template", "--device", "--temperature", "--top-p", "--top-k", "--min-p", "--max-tokens",
                 "--stop", "--presence-penalty", "--frequency-penalty", "--repetition-penalty", "--logprobs",
                 "--n", "--output", "--metrics-json", "--max-in-flight"):
        assert flag in result.output, flag


@pytest.mark.parametrize("error, code", [
    (ConfigError("--dtype", "must be one of auto, float32", hint="use float32"), 2),
    (InputError("bad line", file="a.jsonl", line=3, field="prompt"), 3),
    (ModelLoadError("no such model 'x'"), 4),
])
def test_error_handler_maps_typed_errors(error, code, monkeypatch):
    def boom():
        raise error

    wrapped = cli_errors.handle_errors(boom)
    probe = typer.Typer()
    probe.command()(wrapped)
    result = runner.invoke(probe, [])
    assert result.exit_code == code
    lines = result.stderr.splitlines()
    assert lines[0] == f"error: {error}"
    assert lines[1].startswith("hint: ")
    assert "Traceback" not in result.stderr


def test_interrupt_exits_130():
    def stop():
        raise KeyboardInterrupt

    probe = typer.Typer()
    probe.command()(cli_errors.handle_errors(stop))
    result = runner.invoke(probe, [])
    assert result.exit_code == 130 and result.stderr.startswith("error: interrupted")


def test_debug_shows_the_traceback(tmp_path):
    missing = str(tmp_path / "missing.jsonl")
    plain = runner.invoke(app, ["validate", missing])
    assert plain.exit_code == 3 and "Traceback" not in plain.stderr
    assert plain.stderr.splitlines()[0] == f"error: {missing}: no such file"
    debug = runner.invoke(app, ["--debug", "validate", missing])
    assert debug.exit_code == 3 and "Traceback" in debug.stderr


def test_bad_sampling_flag_is_a_usage_error_naming_the_flag(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text(json.dumps({"prompt": "a"}) + "\n")
    result = runner.invoke(app, ["validate", str(f), "--temperature", "9"])
    assert result.exit_code == 2
    assert result.stderr.splitlines()[0] == "error: --temperature: must be in [0, 2], got 9.0"


def test_models_list_shows_the_catalogue():
    result = runner.invoke(app, ["models", "list"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "smollm2-135m-instruct" in result.output and "(default)" in result.output

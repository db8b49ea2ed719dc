"""`vbatch encode`: a pooling model over files through an IO processor plugin, or over records without one.

    vbatch encode --plugin prithvi tiles/ more/a.tif -o flood/      # one output file per input file
    vbatch encode --model all-minilm-l6-v2 --task embed texts.jsonl -o out.jsonl   # one record per record

With a plugin (`--plugin`, or the model config's `io_processor_plugin`): INPUTS are files and
folders (searched for the plugin's suffixes); every input writes `OUT/<name>`; all inputs share one
engine run (io_plugins/driver.py) and each is written the moment its last request finishes. The
unit of resume and of errors is the file (batch/file_job.py): a rerun skips complete outputs, a bad
file is reported (stderr, the summary, `--metrics-json`) and the others go on. A `.jsonl` file named
as an input holds requests in the plugin's schema, one per line (batch/request_file.py), and writes
`OUT/<name>.jsonl` with one result line each. Without `--model` the plugin's default model is used
(prithvi: the bundled prithvi-flood-tiny).

Without a plugin: one JSONL / Parquet file of records (`text` / `prompt` / `input` /
`prompt_token_ids`, or `multi_modal_data` for a model that takes tensors) through the same machinery
as `vbatch embed` (cli/batch_job.py), writing `{id, data, num_tokens, error}` per record, in order.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from . import options as o
from . import run as run_cmd
from .errors import EXIT_RECORDS_FAILED, handle_errors
from .run import engine_kwargs

PLUGIN = "Plugin (with --plugin)"

Inputs = Annotated[list[str], typer.Argument(help="With a plugin: files and folders (folders are searched for "
                                             "the plugin's files, e.g. *.tif). Without: one .jsonl / .parquet "
                                             "file of records.", show_default=False)]
OutDir = Annotated[str, typer.Option("--output", "-o", help="With a plugin: the output folder (OUT/<input name> "
                                     "per input). Without: the output file (.jsonl / .parquet).")]
PluginName = Annotated[Optional[str], typer.Option("--plugin", help="IO processor plugin (installed ones: "
                                                   "`vbatch encode --plugin x` lists them); default: the model "
                                                   "config's io_processor_plugin.", rich_help_panel=PLUGIN)]
EncodeModel = Annotated[Optional[str], typer.Option("--model", "-m", help="Local folder or catalogue name "
                                                    "(default: the plugin's default model).")]
Task = Annotated[str, typer.Option(help="Without a plugin: embed, classify, token_embed, token_classify or "
                                   "plugin (the model's raw output).")]
Window = Annotated[Optional[int], typer.Option(help="prithvi: window size in pixels (default 512).",
                                               rich_help_panel=PLUGIN)]
Overlap = Annotated[Optional[int], typer.Option(help="prithvi: overlap of neighbouring windows in pixels; their "
                                                "logits are blended (default 0).", rich_help_panel=PLUGIN)]
Indices = Annotated[Optional[str], typer.Option(help="prithvi: the 0-based bands to read, comma-separated "
                                                "(default the first 6; Sentinel-2 L1C: 1,2,3,8,11,12).",
                                                rich_help_panel=PLUGIN)]
Probabilities = Annotated[bool, typer.Option("--probabilities", help="prithvi: also write <name>.probabilities.tif "
                                             "(float32 water probability).", rich_help_panel=PLUGIN)]
Preview = Annotated[bool, typer.Option("--preview", help="prithvi: also write <name>.preview.png (RGB beside "
                                       "the water mask).", rich_help_panel=PLUGIN)]
AllowedPath = Annotated[Optional[list[Path]], typer.Option("--allowed-local-media-path", help="A folder request "
                                                           "records may read from (repeatable); the inputs' "
                                                           "own folders always are.", rich_help_panel=PLUGIN)]


def _plugin_options(window: int | None, overlap: int | None, indices: str | None, probabilities: bool,
                    preview: bool) -> dict[str, Any]:
    from ..engine.errors import ConfigError

    opts: dict[str, Any] = {}
    if window is not None:
        opts["window"] = window
    if overlap is not None:
        opts["overlap"] = overlap
    if indices is not None:
        try:
            opts["indices"] = [int(x) for x in indices.split(",") if x.strip()]
        except ValueError:
            raise ConfigError("--indices", f"must be comma-separated integers, got {indices!r}") from None
    if probabilities:
        opts["probabilities"] = True
    if preview:
        opts["preview"] = True
    return opts


@handle_errors
def encode(
    inputs: Inputs,
    output: OutDir,
    model: EncodeModel = None,
    plugin: PluginName = None,
    task: Task = "embed",
    window: Window = None,
    overlap: Overlap = None,
    indices: Indices = None,
    probabilities: Probabilities = False,
    preview: Preview = False,
    allowed_local_media_path: AllowedPath = None,
    dtype: o.Dtype = "auto",
    max_num_seqs: o.MaxNumSeqs = None,
    max_num_batched_tokens: o.MaxNumBatchedTokens = None,
    device: o.Device = None,
    max_in_flight: o.MaxInFlight = None,
    metrics_json: o.MetricsJson = None,
    on_error: o.OnError = "record",
    shard: o.Shard = None,
    resume: o.Resume = True,
    overwrite: o.Overwrite = False,
    wait_lock: o.WaitLock = False,
) -> None:
    """Run a pooling model over INPUTS: files through an IO processor plugin (one output file each), or
    the records of one batch file (one output record each). A rerun skips what is complete."""
    from ..engine.errors import ConfigError

    kwargs = engine_kwargs(dtype=dtype, max_model_len=None, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=None,
                           enable_prefix_caching=None, seed=None, generation_config=None, device=device)
    if max_in_flight is not None and max_in_flight < 1:
        raise ConfigError("--max-in-flight", f"must be >= 1, got {max_in_flight}")
    plugin_opts = _plugin_options(window, overlap, indices, probabilities, preview)
    name = plugin or _plugin_of_model(model)
    if name is None:
        if plugin_opts or allowed_local_media_path:
            raise ConfigError("--plugin", "plugin options were given but no plugin is chosen")
        if model is None:
            raise ConfigError("--model", "give --model (a pooling model), or --plugin NAME")
        if len(inputs) != 1:
            raise ConfigError("inputs", f"without a plugin, encode reads one batch file, got {len(inputs)}")
        return _encode_records(inputs[0], output, model, task, kwargs, max_in_flight=max_in_flight,
                               metrics_json=metrics_json, on_error=on_error, shard=shard, resume=resume,
                               overwrite=overwrite, wait_lock=wait_lock)
    _encode_files(name, inputs, Path(output), model, kwargs, plugin_opts, list(allowed_local_media_path or []),
                  max_in_flight=max_in_flight, metrics_json=metrics_json, shard=shard, overwrite=overwrite,
                  wait_lock=wait_lock)


def _plugin_of_model(model: str | None) -> str | None:
    if model is None:
        return None
    from ..engine.models.hf_config import load_hf_config
    from ..engine.models.resolve import resolve_model
    from ..io_plugins.registry import select_plugin

    return select_plugin(None, load_hf_config(resolve_model(model, quiet=True).path))


# ---------------------------------------------------------------------------- without a plugin
def _encode_records(file: str, output: str, model: str, task: str, kwargs: dict[str, Any], **run: Any) -> None:
    from ..batch.jobs import PoolingJob
    from ..engine.errors import ConfigError
    from ..engine.pooling_params import POOLING_TASKS, PoolingParams

    from .batch_job import JobSpec, run_job

    if task not in POOLING_TASKS or task == "score":
        raise ConfigError("--task", f"must be one of {', '.join(t for t in POOLING_TASKS if t != 'score')}, "
                          f"got {task!r}", hint="scores of text pairs: LLM.score in Python")
    params = PoolingParams()
    spec = JobSpec(
        command="encode", file=file, output=output, model=model, engine_kwargs=kwargs,
        output_options={"model": model, "dtype": kwargs.get("dtype"), "task": task},
        make_job=lambda llm: PoolingJob(params, task), pooling=True, reader_kind="encode", record_kind="encode",
        max_in_flight=run["max_in_flight"] or 4 * (kwargs.get("max_num_seqs") or 256),
        metrics_json=run["metrics_json"], on_error=run["on_error"], shard=run["shard"], resume=run["resume"],
        overwrite=run["overwrite"], wait_lock=run["wait_lock"])
    run_job(spec, lambda name, kw: run_cmd.load_llm(name, kw))


# ---------------------------------------------------------------------------- with a plugin
def _encode_files(plugin: str, args: list[str], out_dir: Path, model: str | None, kwargs: dict[str, Any],
                  plugin_opts: dict[str, Any], allowed: list[Path], *, max_in_flight: int | None,
                  metrics_json: Path | None, shard: str | None, overwrite: bool, wait_lock: bool) -> None:
    from ..batch.file_job import collect_inputs
    from ..batch.output_lock import output_lock
    from ..batch.shard import resolve_shard
    from ..engine.errors import ConfigError
    from ..io_plugins.registry import load_plugin_class

    cls = load_plugin_class(plugin)                       # an unknown name lists the installed ones
    model = model or cls.default_model
    if model is None:
        raise ConfigError("--model", f"the {plugin} plugin has no default model: give --model")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError("--output", f"{out_dir} is a file; with a plugin -o names a folder")
    if not cls.input_suffixes and any(Path(a).is_dir() for a in args):
        raise ConfigError("inputs", f"the {plugin} plugin names no input files to look for in folders: "
                          "give the files")
    inputs = collect_inputs(args, cls.input_suffixes)
    the_shard = resolve_shard(shard)
    out_dir.mkdir(parents=True, exist_ok=True)
    # One run per shard of the folder (shards of a job array share it: each holds its own lock).
    lock = out_dir / f".vbatch-encode.part-{the_shard.index}-of-{the_shard.count}"
    with output_lock(str(lock), wait=wait_lock, what="output folder"):
        _encode_files_locked(plugin, cls, inputs, the_shard, out_dir, model, kwargs, plugin_opts, allowed,
                             max_in_flight=max_in_flight, metrics_json=metrics_json, overwrite=overwrite)


def _encode_files_locked(plugin: str, cls: type, inputs: list, the_shard: Any, out_dir: Path, model: str,
                         kwargs: dict[str, Any], plugin_opts: dict[str, Any], allowed: list[Path], *,
                         max_in_flight: int | None, metrics_json: Path | None, overwrite: bool) -> None:
    from ..batch.file_job import plan_files
    from ..batch.request_file import RequestFile
    from ..engine.errors import ConfigError
    from ..io_plugins.driver import PluginInput, run_plugin

    from .signals import StopSignals

    manifest = {"command": "encode", "plugin": plugin, "model": model, "dtype": kwargs.get("dtype"),
                "options": plugin_opts}
    plan = plan_files(inputs, out_dir, manifest, shard=the_shard, overwrite=overwrite)
    if not the_shard.is_whole:
        typer.echo(f"shard {the_shard.spec()} (from {the_shard.source}): {len(plan.todo) + len(plan.done)} of "
                   f"{plan.num_inputs} inputs", err=True)
    if plan.done:
        typer.echo(f"{len(plan.done)} outputs already complete in {out_dir}; skipped", err=True)
    done_errors = _errors_in_done_request_files(plan.done, out_dir)
    if done_errors:
        typer.echo(f"{done_errors} requests in complete request-file outputs failed earlier "
                   "(their error lines are in those files)", err=True)
    if not plan.todo:
        typer.echo("nothing to do", err=True)
        if done_errors:
            raise typer.Exit(EXIT_RECORDS_FAILED)
        return

    folders = sorted({str(f.path.resolve().parent) for f in plan.todo} | {str(p.resolve()) for p in allowed})
    options = {**plugin_opts, "allowed_local_media_path": folders}
    llm = run_cmd.load_llm(model, {**kwargs, "io_processor_plugin": plugin, "io_processor_options": options})
    if not llm.is_pooling_model:
        raise ConfigError("--model", f"{model} is a generation model; the {plugin} plugin needs its pooling model")
    for f in plan.todo:
        (out_dir / f.name).parent.mkdir(parents=True, exist_ok=True)
    # A .jsonl input is a file of requests (batch/request_file.py): one output for all its lines.
    request_files = {f.name: RequestFile(f, out_dir) for f in plan.todo if f.path.suffix.lower() == ".jsonl"}
    owner: dict[str, RequestFile] = {}

    def requests():
        for f in plan.todo:
            rf = request_files.get(f.name)
            if rf is None:
                yield PluginInput(f.name, {"data_format": "path", "data": str(f.path.resolve()),
                                           "out_data_format": "path", "out_path": str(out_dir / f.name)})
                continue
            items = rf.inputs()
            owner.update((i.key, rf) for i in items)
            yield from items

    t0, stats0 = time.perf_counter(), llm.stats.num_requests
    ok, failed = 0, []
    progress = _Progress(len(plan.todo))

    def file_done(rf: RequestFile) -> None:
        nonlocal ok
        rf.write()
        ok += 1
        for n, line in sorted(rf.results.items()):
            if line.get("error"):
                failed.append({"input": f"{rf.file.name}:{n}", "error": line["error"]})
                typer.echo(f"error: {rf.file.name}:{n}: {line['error']}", err=True)

    for rf in request_files.values():
        if not rf.requests:            # nothing to run (every line bad, or an empty file)
            file_done(rf)
    with StopSignals() as stop:
        results = run_plugin(llm, llm.io_processor, requests(), max_in_flight=max_in_flight or 64,
                             should_stop=stop.is_set)
        for r in results:
            if r.key in owner:
                if owner[r.key].record(r):
                    file_done(owner[r.key])
            elif r.ok:
                ok += 1
            else:
                failed.append({"input": r.key, "error": r.error})
                typer.echo(f"error: {r.key}: {r.error}", err=True)
            progress.update(ok + len(failed), len(failed))
    progress.line(ok + len(failed), len(failed))
    seconds = time.perf_counter() - t0
    windows = llm.stats.num_requests - stats0
    names = {f.name for f in plan.todo}
    summary = {"command": "encode", "plugin": plugin, "model": model, "output": str(out_dir),
               "shard": the_shard.spec(), "inputs": plan.num_inputs, "written": ok, "failed": len(failed),
               "skipped_complete": len(plan.done),
               "not_run": len(plan.todo) - ok - sum(1 for e in failed if e["input"] in names),
               "requests": windows, "seconds": round(seconds, 3),
               "requests_per_s": round(windows / seconds, 3) if seconds > 0 else None, "errors": failed}
    _print_summary(summary)
    if metrics_json is not None:
        metrics_json.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    if stop.is_set():
        typer.echo(f"stopped by {stop.name}: {ok} outputs written this run; rerun the same command to "
                   "finish (complete outputs are skipped)", err=True)
        raise typer.Exit(stop.exit_code)
    if failed or done_errors:
        raise typer.Exit(EXIT_RECORDS_FAILED)


def _errors_in_done_request_files(done: Any, out_dir: Path) -> int:
    """Error lines in the outputs of request files a rerun skips (the file is done; its failures stay reported)."""
    count = 0
    for f in done:
        if f.path.suffix.lower() == ".jsonl":
            for raw in (out_dir / f.name).read_text(encoding="utf-8").splitlines():
                count += bool(raw.strip()) and json.loads(raw).get("error") is not None
    return count


class _Progress:
    """A line on stderr every `every_s` seconds and at the end (for terminals and batch logs alike)."""

    def __init__(self, total: int, every_s: float = 10.0) -> None:
        self.total, self.every_s = total, every_s
        self.t0 = self.last = time.perf_counter()

    def update(self, done: int, errors: int) -> None:
        if time.perf_counter() - self.last >= self.every_s:
            self.line(done, errors)

    def line(self, done: int, errors: int) -> None:
        self.last = time.perf_counter()
        rate = done / max(self.last - self.t0, 1e-9)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        typer.echo(f"[{stamp}] {done}/{self.total} inputs, {errors} errors, {rate:.2f} inputs/s", err=True)


def _print_summary(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"vbatch encode --plugin {s['plugin']}", show_header=False)
    for key in ("model", "output", "shard", "inputs", "written", "failed", "skipped_complete", "not_run",
                "requests", "seconds", "requests_per_s"):
        table.add_row(key.replace("_", " "), str(s[key]))
    Console(stderr=True).print(table)

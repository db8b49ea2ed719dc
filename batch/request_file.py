"""A JSONL file of plugin requests as one input of `vbatch encode --plugin` (terratorch's request schema).

    {"data_format": "path", "data": "tiles/a.tif", "out_data_format": "path", "out_path": "maps/a.tif"}
    {"data_format": "b64_json", "data": "<base64 GeoTIFF>", "out_data_format": "b64_json", "request_id": "x"}

Each line is one plugin input (a request the plugin's parse_data checks); the file's own output
`OUT/<name>.jsonl` gets one result line per request line, in order, written atomically once every
request of the file is done, so the file is the unit of resume as a tile is. Paths: `data` relative
to the JSONL's folder; `out_path` relative to OUT (default: `data`'s file name, or `<name>-line<N>.tif` for inline data) and
never outside it.
A line that is not a JSON object, or points outside OUT, gets its error line and the others go on.
"""
from __future__ import annotations

import json
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from ..io_plugins.driver import PluginInput, PluginResult
from .atomic_file import write_file_atomically
from .file_job import FileInput


class RequestFile:
    def __init__(self, file: FileInput, out_dir: Path) -> None:
        self.file, self.out_dir = file, out_dir
        self.results: dict[int, dict[str, Any]] = {}
        self.requests: dict[int, dict[str, Any]] = {}     # line -> request
        base = file.path.resolve().parent
        text = file.path.read_text(encoding="utf-8", errors="replace")
        for n, raw in enumerate(text.splitlines(), 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError as e:
                self.results[n] = _error(n, None, f"invalid JSON: {e}")
                continue
            if not isinstance(obj, dict):
                self.results[n] = _error(n, None, f"must be a JSON object, got {type(obj).__name__}")
                continue
            request = dict(obj)
            if request.get("data_format", "path") == "path" and isinstance(request.get("data"), str):
                request["data"] = str((base / request["data"]).resolve())
            if request.get("out_data_format") == "path" or "out_path" in request:
                request.setdefault("out_data_format", "path")
                default = (Path(request["data"]).name if request.get("data_format", "path") == "path"
                           and isinstance(request.get("data"), str) else f"{file.path.stem}-line{n}.tif")
                target = (out_dir / (request.get("out_path") or default)).resolve()
                if out_dir.resolve() not in target.parents:
                    self.results[n] = _error(n, obj.get("request_id"), f"out_path {request.get('out_path')!r} "
                                             f"is outside the output folder {out_dir}")
                    continue
                request["out_path"] = str(target)
            self.requests[n] = request
        self.num_lines = len(self.requests) + len(self.results)

    @property
    def output_path(self) -> Path:
        return self.out_dir / self.file.name

    def inputs(self) -> list[PluginInput]:
        # The request id is ours to echo, not a field the plugin reads.
        return [PluginInput(f"{self.file.name}:{n}", {k: v for k, v in r.items() if k != "request_id"})
                for n, r in self.requests.items()]

    def record(self, result: PluginResult) -> bool:
        """Store one request's result; True when the file's last one is in."""
        n = int(result.key.rsplit(":", 1)[1])
        rid = self.requests[n].get("request_id")
        if result.ok:
            out = asdict(result.output) if is_dataclass(result.output) else result.output
            out = out if isinstance(out, dict) else {"data": out}
            self.results[n] = {"line": n, **out, "request_id": rid, "error": None}
        else:
            self.results[n] = _error(n, rid, result.error)
        return len(self.results) == self.num_lines

    @property
    def num_errors(self) -> int:
        return sum(1 for r in self.results.values() if r.get("error"))

    def write(self) -> None:
        lines = [json.dumps(self.results[n], ensure_ascii=False) for n in sorted(self.results)]
        write_file_atomically(str(self.output_path), ("\n".join(lines) + "\n").encode("utf-8") if lines else b"")


def _error(line: int, request_id: Any, message: str | None) -> dict[str, Any]:
    return {"line": line, "request_id": request_id, "error": message}

"""GGUF -> Hugging Face folder (config.json, model.safetensors, tokenizer files), done once.

Called by `resolve` when a model is a .gguf file (a catalogue entry or the user's own).
transformers reads the GGUF (`gguf_file=`; it dequantises to fp32 and undoes llama.cpp's
Q/K row permutation), but refuses `save_pretrained` on a GGUF-loaded model, so the
tensors are written here with safetensors. The folder is built under a temporary name and
renamed into place as the last step: a folder that exists is always complete.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ..errors import ModelLoadError

MARKER = "vbatch_source.json"
"""Written last into every converted folder: what it was converted from, and when."""


def _chat_template_from_gguf(gguf_path: Path) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    value = field.contents()
    return value if isinstance(value, str) and value else None


def _unique_tensors(state_dict: dict) -> dict:
    """Drops aliases (a tied lm_head shares the embedding's storage): each tensor is saved once."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    unique = {}
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        unique[name] = tensor.detach().contiguous()
    return unique


def _write_folder(gguf_path: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not getattr(tokenizer, "chat_template", None):
        template = _chat_template_from_gguf(gguf_path)
        if template:
            tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out))

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = model.config
    tensors = _unique_tensors(model.state_dict())
    if "lm_head.weight" not in tensors and "lm_head.weight" in model.state_dict():
        # Only an alias of the embedding was dropped: loaders must tie it back.
        config.tie_word_embeddings = True
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved tensors are plain fp32, not GGUF blocks
    config.architectures = [type(model).__name__]
    config.dtype = "float32"
    config.save_pretrained(str(out))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    generation = {k: getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    generation = {k: v for k, v in generation.items() if v is not None}
    if generation:
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _publishable(folder: Path) -> None:
    """mkdtemp makes 0700 folders; the cache is shared like any ~/.cache entry, so use the umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for child in folder.iterdir():
        os.chmod(child, 0o666 & ~umask)


def _quiet_progress(quiet: bool):
    """transformers draws tqdm bars while it dequantises; `quiet` must mean quiet.

    The dequantising loop calls tqdm directly (no transformers switch turns it off), and tqdm
    binds its env defaults at import, so stderr itself is muted for the conversion; failures
    still surface as exceptions.
    """
    import contextlib

    if not quiet:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    sink = stack.enter_context(open(os.devnull, "w"))
    stack.enter_context(contextlib.redirect_stderr(sink))
    return stack


def convert_gguf(gguf_path: Path, out: Path, *, source: dict, quiet: bool) -> Path:
    """Converts `gguf_path` into the HF folder `out` unless a complete one is already there."""
    if (out / MARKER).is_file():
        return out
    if not quiet:
        print(f"vbatch: converting {gguf_path.name} into {out} (once; later loads reuse it)",
              file=sys.stderr, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    started = time.time()
    try:
        try:
            with _quiet_progress(quiet):
                _write_folder(gguf_path, tmp)
        except Exception as e:  # noqa: BLE001  transformers raises many kinds for a bad/unknown GGUF
            raise ModelLoadError(f"could not convert {gguf_path} to a Hugging Face folder: {e}",
                                 hint="check that the file is a complete GGUF of a llama-family model") from e
        marker = dict(source, seconds=round(time.time() - started, 1), converted_at=time.time())
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _publishable(tmp)
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / MARKER).is_file():
                # A stale, incomplete folder (older vbatch or a crash between rename steps).
                shutil.rmtree(out, ignore_errors=True)
                os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        print(f"vbatch: converted in {time.time() - started:.1f} s", file=sys.stderr, flush=True)
    return out

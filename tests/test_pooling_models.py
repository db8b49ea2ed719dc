"""Pooling models against transformers: all-MiniLM-L6-v2 (the real checkpoint) and a BERT
cross-encoder with random weights; the sentence-transformers pooling config reader."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from vbatch.engine.errors import ModelLoadError, PoolingParamsError, UnsupportedModelError
from vbatch.engine.models.pooling_config import read_pooler_config
from vbatch.engine.pooling_params import PoolingParams

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "Two men pushed carts through the woods.",
    "x",
    "The new movie is awesome, and the actors, who had trained for months, played every scene with "
    "care; critics wrote that nothing like it had been seen in years, and audiences agreed.",
    "Un homme mange du pain.",
]


@pytest.fixture(scope="module")
def llm(minilm_path):
    from vbatch import LLM
    return LLM(str(minilm_path), quiet=True)


@pytest.fixture(scope="module")
def hf_embeddings(minilm_path):
    """sentence-transformers' recipe by hand on transformers' BertModel: mean over the attention mask, L2."""
    from transformers import AutoModel, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(minilm_path))
    model = AutoModel.from_pretrained(str(minilm_path)).eval()
    enc = tok(SENTENCES, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state                                  # [B, L, 384]
    mask = enc["attention_mask"][..., None].float()
    mean = (hidden * mask).sum(1) / mask.sum(1)
    return F.normalize(mean, dim=-1), hidden, enc["attention_mask"]


def test_minilm_embeddings_match_transformers(llm, hf_embeddings):
    want, _, _ = hf_embeddings
    outs = llm.embed(SENTENCES)                     # one engine step: packed, grouped by length
    got = torch.tensor([o.outputs.embedding for o in outs])
    assert got.shape == (len(SENTENCES), 384)
    cos = F.cosine_similarity(got, want, dim=-1)
    assert float(cos.min()) > 1 - 1e-5, cos
    assert float((got - want).abs().max()) < 1e-4
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5, rtol=0)


def test_minilm_published_pair_similarity(llm):
    a, b = llm.embed(["A man is eating food.", "A man is eating a piece of bread."])
    cos = float(torch.tensor(a.outputs.embedding) @ torch.tensor(b.outputs.embedding))
    assert round(cos, 4) == 0.7553
    (score,) = llm.score("A man is eating food.", "A man is eating a piece of bread.")
    assert abs(score.outputs.score - cos) < 1e-6


def test_an_embedding_does_not_depend_on_its_batch(llm):
    alone = torch.tensor(llm.embed(SENTENCES[2])[0].outputs.embedding)
    batched = torch.tensor(llm.embed(SENTENCES)[2].outputs.embedding)
    assert float((alone - batched).abs().max()) < 1e-5
    # a step of ~6,000 tokens runs in several sub-batches (pooling_runner.SUB_BATCH_TOKENS): same vectors
    many = llm.embed(SENTENCES * 60)
    assert sum(len(o.prompt_token_ids) for o in many) > 2 * 2048
    for i in (2, 8 * 30 + 2, len(many) - 6):
        assert float((torch.tensor(many[i].outputs.embedding) - alone).abs().max()) < 1e-5


def test_token_embed_matches_transformers_hidden_states(llm, hf_embeddings):
    _, hidden, mask = hf_embeddings
    out = llm.encode(SENTENCES[:2], pooling_task="token_embed")
    for i, o in enumerate(out):
        n = int(mask[i].sum())
        assert o.outputs.data.shape == (n, 384) and len(o.prompt_token_ids) == n
        torch.testing.assert_close(o.outputs.data, F.normalize(hidden[i, :n], dim=-1), atol=1e-4, rtol=1e-4)
    raw = llm.encode(SENTENCES[:1], PoolingParams(normalize=False), pooling_task="token_embed")[0]
    torch.testing.assert_close(raw.outputs.data, hidden[0, :int(mask[0].sum())], atol=1e-4, rtol=1e-4)


def test_normalize_off_gives_the_mean(llm, hf_embeddings):
    out = llm.embed(SENTENCES[:1], PoolingParams(normalize=False))[0]
    v = torch.tensor(out.outputs.embedding)
    assert abs(float(v.norm()) - 1.0) > 1e-3          # not normalised
    _, hidden, mask = hf_embeddings
    n = int(mask[0].sum())
    torch.testing.assert_close(v, hidden[0, :n].mean(0), atol=1e-4, rtol=1e-4)


def test_limits_and_bad_params_are_clear_errors(llm):
    assert llm.engine.max_model_len == 256           # sentence_bert_config.json max_seq_length
    from vbatch.engine.errors import InputError, UnsupportedTaskError
    with pytest.raises(InputError, match="max_model_len is 256"):
        llm.embed("word " * 300)
    cut = llm.embed("word " * 300, truncate_prompt_tokens=-1)[0]
    assert len(cut.prompt_token_ids) == 256 and cut.prompt_token_ids[0] == 101 and cut.prompt_token_ids[-1] == 102
    with pytest.raises(PoolingParamsError, match="matryoshka"):
        llm.embed("x", PoolingParams(dimensions=64))
    with pytest.raises(PoolingParamsError, match="does not support 'classify'"):
        llm.classify("x")
    with pytest.raises(UnsupportedTaskError, match="does not generate"):
        llm.generate("x")
    with pytest.raises(UnsupportedTaskError, match="needs pooling_task"):
        llm.encode("x")
    assert not llm.engine.has_unfinished_requests()


# ---------------------------------------------------------------------------- a BERT cross-encoder
def _tiny_bert_config(num_labels: int):
    from transformers import BertConfig
    return BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, max_position_embeddings=64, num_labels=num_labels,
                      architectures=["BertForSequenceClassification"])


def _save_classifier(tmp_path, num_labels, minilm_path):
    """A random-weight BertForSequenceClassification folder with MiniLM's tokenizer (vocab clipped by ids)."""
    from transformers import BertForSequenceClassification
    torch.manual_seed(0)
    model = BertForSequenceClassification(_tiny_bert_config(num_labels)).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


@pytest.mark.parametrize("num_labels", [1, 3])
def test_bert_classifier_matches_transformers(tmp_path, num_labels, minilm_path):
    from vbatch import LLM
    hf = _save_classifier(tmp_path, num_labels, minilm_path)
    import shutil
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_path / name, tmp_path / name)
    llm = LLM(str(tmp_path), quiet=True)
    pairs = [([5, 17, 33, 2], [0, 0, 1, 1]), ([9, 8, 7, 6, 5, 4, 3], [0, 0, 0, 0, 1, 1, 1]), ([11, 12], [0, 1])]
    prompts = [{"prompt_token_ids": ids, "token_type_ids": types} for ids, types in pairs]
    outs = llm.encode(prompts, pooling_task="classify")
    for (ids, types), out in zip(pairs, outs):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits[0]
        want = torch.sigmoid(logits) if num_labels == 1 else torch.softmax(logits, -1)
        torch.testing.assert_close(out.outputs.data, want, atol=1e-5, rtol=1e-5)
    probs = llm.classify([prompts[0]])[0].outputs
    assert probs.num_classes == num_labels
    if num_labels == 1:   # a cross-encoder scores text pairs read together (token types 0 | 1)
        a, b = "hello", "world"
        enc = llm.get_tokenizer()(a, b)
        with torch.no_grad():
            logit = hf(input_ids=torch.tensor([enc["input_ids"]]),
                       token_type_ids=torch.tensor([enc["token_type_ids"]])).logits[0, 0]
        (s,) = llm.score(a, b)
        assert abs(s.outputs.score - float(torch.sigmoid(logit))) < 1e-5
        raw = llm.score(a, b, pooling_params=PoolingParams(use_activation=False))[0]
        assert abs(raw.outputs.score - float(logit)) < 1e-5
    else:
        with pytest.raises(PoolingParamsError, match="does not support 'score'"):
            llm.encode([prompts[0]], pooling_task="score")


def test_strict_loading_names_missing_and_unexpected_tensors(tmp_path, minilm_path):
    from safetensors.torch import load_file, save_file
    import shutil
    from vbatch import LLM
    for f in minilm_path.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    shutil.copytree(minilm_path / "1_Pooling", tmp_path / "1_Pooling")
    state = load_file(minilm_path / "model.safetensors")
    state.pop("encoder.layer.3.output.dense.bias")
    state["encoder.layer.0.extra.weight"] = torch.zeros(2)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="unexpected tensors in the checkpoint: encoder.layer.0.extra.weight"):
        LLM(str(tmp_path), quiet=True)
    state.pop("encoder.layer.0.extra.weight")
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing from the checkpoint: encoder.layer.3.output.dense.bias"):
        LLM(str(tmp_path), quiet=True)


# ---------------------------------------------------------------------------- pooling config
def _st_folder(tmp_path, modes: dict, modules=("Transformer", "Pooling", "Normalize"), max_seq=128):
    mods = [{"idx": i, "name": str(i), "path": "1_Pooling" if m == "Pooling" else "",
             "type": f"sentence_transformers.models.{m}"} for i, m in enumerate(modules)]
    (tmp_path / "modules.json").write_text(json.dumps(mods))
    (tmp_path / "1_Pooling").mkdir(exist_ok=True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **modes}))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq}))
    return tmp_path


def test_pooling_config_from_sentence_transformers_files(tmp_path, minilm_path):
    cfg = read_pooler_config(minilm_path, "CLS")
    assert (cfg.pooling_type, cfg.normalize, cfg.max_seq_length, cfg.source) == ("MEAN", True, 256,
                                                                                  "sentence-transformers")
    assert read_pooler_config(tmp_path, "CLS").pooling_type == "CLS"          # nothing there: the default
    f = _st_folder(tmp_path, {"pooling_mode_cls_token": True}, modules=("Transformer", "Pooling"))
    cfg = read_pooler_config(f, "MEAN")
    assert (cfg.pooling_type, cfg.normalize, cfg.max_seq_length) == ("CLS", False, 128)
    _st_folder(tmp_path, {"pooling_mode_lasttoken": True})
    assert read_pooler_config(tmp_path, "CLS").pooling_type == "LAST"
    _st_folder(tmp_path, {"pooling_mode_max_tokens": True})
    with pytest.raises(UnsupportedModelError, match="pooling_mode_max_tokens is not supported"):
        read_pooler_config(tmp_path, "CLS")
    _st_folder(tmp_path, {"pooling_mode_mean_tokens": True}, modules=("Transformer", "Pooling", "Dense"))
    with pytest.raises(UnsupportedModelError, match="'sentence_transformers.models.Dense' is not supported"):
        read_pooler_config(tmp_path, "CLS")


def test_dtype_auto_keeps_encoders_in_fp32_even_where_bf16_is_fast(monkeypatch):
    from vbatch.engine import device
    monkeypatch.setattr(device, "cpu_has_fast_bf16", lambda: True)
    cpu = torch.device("cpu")
    assert device.resolve_dtype("auto", cpu) == torch.bfloat16                 # decoders: the fast dtype
    assert device.resolve_dtype("auto", cpu, exact_on_cpu=True) == torch.float32
    assert device.resolve_dtype("bfloat16", cpu, exact_on_cpu=True) == torch.bfloat16


def test_bf16_embeddings_stay_close_to_fp32(llm, minilm_path):
    """--dtype bfloat16 on this CPU's bf16 path (oneDNN/zentorch bf16 GEMMs with avx512_bf16, torch's
    elsewhere): every embedding within cosine 0.999 of the fp32 one (bf16 rounds each op's result)."""
    from vbatch import LLM
    half = LLM(str(minilm_path), dtype="bfloat16", quiet=True)
    assert half.engine.dtype == torch.bfloat16 and llm.engine.dtype == torch.float32
    a = torch.tensor([o.outputs.embedding for o in half.embed(SENTENCES)])
    b = torch.tensor([o.outputs.embedding for o in llm.embed(SENTENCES)])
    cos = F.cosine_similarity(a, b, dim=-1)
    assert float(cos.min()) > 0.999, cos          # measured here: 0.9999 or more for every sentence

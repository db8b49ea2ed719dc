"""Tensor-input pooling requests end to end: a terratorch folder (config.json without model_type + a
Lightning .pt with terratorch's key names) loads through the engine, takes vLLM's
`{"multi_modal_data": {"pixel_values": ...}}` prompts, budgets them by patches, batches same-shaped
tiles, and returns the same logits as the model run directly, one tile at a time."""
from __future__ import annotations

import json

import pytest
import torch

from vbatch.engine.errors import InputError, ModelLoadError
from vbatch.engine.llm import LLM
from vbatch.engine.pooling_params import PoolingParams

from test_prithvi_model import CH, C, CLASSES, D, DEPTH, HEADS, IMG, random_state, reference_forward  # noqa: E402


def terratorch_config(**extra) -> dict:
    """The vLLM / terratorch config.json of CFG (no model_type, as the released folders)."""
    args = {"backbone": "prithvi_eo_tiny", "backbone_embed_dim": D, "backbone_depth": DEPTH,
            "backbone_num_heads": HEADS, "backbone_img_size": IMG, "backbone_coords_encoding": ["time", "location"],
            "backbone_bands": ["BLUE", "GREEN", "RED", "NIR_NARROW", "SWIR_1", "SWIR_2"],
            "necks": [{"name": "SelectIndices", "indices": [0, 1, 2, 3]}, {"name": "ReshapeTokensToImage"}],
            "decoder": "UperNetDecoder", "decoder_channels": CH, "decoder_scale_modules": True,
            "num_classes": CLASSES, "head_dropout": 0.0, "rescale": True}
    return {"architectures": ["Terratorch"], "num_classes": CLASSES,
            "pretrained_cfg": {"seed_everything": 0, "input": {"target": "pixel_values", "data": {
                "pixel_values": {"type": "torch.Tensor", "shape": [C, 512, 512]},
                "location_coords": {"type": "torch.Tensor", "shape": [1, 2]}}},
                "model": {"class_path": "terratorch.tasks.SemanticSegmentationTask",
                          "init_args": {"model_args": args, "model_factory": "EncoderDecoderFactory"}}}, **extra}


def write_terratorch_folder(folder, state, **extra):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(terratorch_config(**extra)))
    torch.save({"state_dict": state, "epoch": 3}, folder / "Prithvi-tiny-Sen1Floods11.pt")
    return folder


@pytest.fixture(scope="module")
def state():
    return random_state(seed=4)


@pytest.fixture(scope="module")
def llm(tmp_path_factory, state):
    folder = write_terratorch_folder(tmp_path_factory.mktemp("prithvi") / "model", state)
    return LLM(str(folder), quiet=True)


def tile(seed, h=64, w=64):
    return torch.randn(C, h, w, generator=torch.Generator().manual_seed(seed))


def test_the_folder_loads_as_a_tensor_pooling_model(llm):
    assert llm.is_pooling_model and llm.get_tokenizer() is None
    assert llm.engine.pooling_info.supported_tasks == ("plugin",)
    assert llm.engine.num_kv_blocks == 0


def test_logits_equal_the_independent_implementation_and_batching_changes_nothing(llm, state):
    tiles = [tile(i) for i in range(5)] + [tile(9, 70, 45)]
    prompts = [{"prompt_token_ids": [1], "multi_modal_data": {"pixel_values": t}} for t in tiles]
    together = llm.encode(prompts, pooling_task="plugin")
    alone = [llm.encode(p, pooling_task="plugin")[0] for p in prompts]
    for t, a, b in zip(tiles, together, alone):
        assert a.outputs.data.shape == (CLASSES, *t.shape[1:])
        torch.testing.assert_close(a.outputs.data, b.outputs.data, atol=1e-5, rtol=1e-5)
        want = reference_forward(state, t[None])[0]
        torch.testing.assert_close(a.outputs.data, want, atol=2e-4, rtol=2e-4)
        assert a.prompt_token_ids == []


def test_the_scheduler_budgets_a_tile_by_its_patches(llm):
    before = llm.stats.prompt_tokens
    llm.encode({"multi_modal_data": {"pixel_values": tile(1, 96, 128)}}, pooling_task="plugin")
    assert llm.stats.prompt_tokens - before == (96 // 16) * (128 // 16) + 1


def test_coordinates_and_activation(llm, state):
    t = tile(3)
    loc = torch.tensor([[45.5, -73.6]])
    out = llm.encode({"multi_modal_data": {"pixel_values": t[None], "location_coords": loc}}, pooling_task="plugin")
    torch.testing.assert_close(out[0].outputs.data, reference_forward(state, t[None], location=loc)[0],
                               atol=2e-4, rtol=2e-4)
    probs = llm.encode({"multi_modal_data": {"pixel_values": t}}, PoolingParams(use_activation=True),
                       pooling_task="plugin")[0].outputs.data
    torch.testing.assert_close(probs.sum(0), torch.ones(64, 64))
    assert probs.min() >= 0


@pytest.mark.parametrize("prompt, field, message", [
    ("a text", "multi_modal_data", "takes tensors"),
    ({"multi_modal_data": {"pixel_values": torch.zeros(3, 8, 8)}}, "multi_modal_data.pixel_values", r"must be \[6,"),
    ({"multi_modal_data": {"pixel_values": torch.full((6, 8, 8), float("nan"))}}, "multi_modal_data.pixel_values",
     "NaN"),
    ({"multi_modal_data": {"pixels": torch.zeros(6, 8, 8)}}, "multi_modal_data.pixels", "not an input"),
    ({"multi_modal_data": {"pixel_values": torch.zeros(6, 8, 8), "location_coords": [1.0]}},
     "multi_modal_data.location_coords", "2 finite numbers"),
    ({"multi_modal_data": {"pixel_values": "not a tensor"}}, "multi_modal_data.pixel_values", "must be a tensor"),
])
def test_bad_tensor_prompts_name_the_field(llm, prompt, field, message):
    with pytest.raises(InputError, match=message) as e:
        llm.encode(prompt, pooling_task="plugin")
    assert e.value.field == field
    assert not llm.engine.has_unfinished_requests()


def test_a_tile_over_max_model_len_is_refused(llm):
    with pytest.raises(InputError, match="max_model_len"):
        llm.encode({"multi_modal_data": {"pixel_values": torch.zeros(6, 16 * 100, 16 * 100)}}, pooling_task="plugin")


def test_nested_lists_from_json_are_tensors(llm):
    t = tile(5, 32, 32)
    a = llm.encode({"multi_modal_data": {"pixel_values": t.tolist()}}, pooling_task="plugin")[0].outputs.data
    b = llm.encode({"multi_modal_data": {"pixel_values": t}}, pooling_task="plugin")[0].outputs.data
    torch.testing.assert_close(a, b)


def test_a_tiny_tile_pads_by_repeating_its_edge(llm):
    out = llm.encode({"multi_modal_data": {"pixel_values": tile(6, 10, 7)}}, pooling_task="plugin")[0]
    assert out.outputs.data.shape == (CLASSES, 10, 7) and torch.isfinite(out.outputs.data).all()


def test_two_checkpoints_in_one_folder_are_ambiguous(tmp_path, state):
    folder = write_terratorch_folder(tmp_path / "m", state)
    torch.save(state, folder / "other.ckpt")
    with pytest.raises(ModelLoadError, match="2 checkpoints"):
        LLM(str(folder), quiet=True)


def test_a_terratorch_backbone_we_do_not_serve_is_named(tmp_path, state):
    from vbatch.engine.errors import UnsupportedModelError
    folder = write_terratorch_folder(tmp_path / "m", state)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["pretrained_cfg"]["model"]["init_args"]["model_args"]["backbone"] = "timm_resnet50"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="timm_resnet50"):
        LLM(str(folder), quiet=True)


def test_a_model_with_one_task_needs_no_pooling_task(llm, state):
    t = tile(12)
    out = llm.encode({"multi_modal_data": {"pixel_values": t}})[0].outputs.data
    torch.testing.assert_close(out, reference_forward(state, t[None])[0], atol=2e-4, rtol=2e-4)

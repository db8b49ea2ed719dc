"""generation_config modes (REFERENCE 1.2): auto / vllm / folder, sampling overrides and EOS ids."""
import json

import pytest
import torch

from vbatch.engine.errors import ConfigError
from vbatch.engine.generation_config import GenerationDefaults, load_generation_defaults

torch.set_num_threads(1)


def _write(folder, name, data):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(data))


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "model"
    _write(folder, "config.json", {"model_type": "llama", "eos_token_id": 2})
    _write(folder, "generation_config.json", {
        "do_sample": False, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_new_tokens": 100, "eos_token_id": [2, 5], "bos_token_id": 1})
    return folder


def test_auto_reads_sampling_values_and_extra_eos(model_dir):
    defaults = load_generation_defaults(model_dir, "auto")
    # do_sample=false does not switch the values off (vLLM reads them regardless).
    assert defaults.sampling_overrides == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                           "repetition_penalty": 1.1, "max_tokens": 100}
    assert defaults.eos_token_ids == (2, 5)


def test_vllm_mode_has_no_overrides_but_keeps_eos_ids(model_dir):
    assert load_generation_defaults(model_dir, "vllm") == GenerationDefaults({}, (2, 5))


def test_auto_without_file_uses_config_eos_only(tmp_path):
    folder = tmp_path / "bare"
    _write(folder, "config.json", {"eos_token_id": [7, 8]})
    assert load_generation_defaults(folder, "auto") == GenerationDefaults({}, (7, 8))


def test_folder_mode_reads_that_folder(model_dir, tmp_path):
    other = tmp_path / "gen"
    _write(other, "generation_config.json", {"temperature": 0.3, "presence_penalty": 0.5,
                                             "frequency_penalty": -0.5, "eos_token_id": 9})
    defaults = load_generation_defaults(model_dir, str(other))
    assert defaults.sampling_overrides == {"temperature": 0.3, "presence_penalty": 0.5, "frequency_penalty": -0.5}
    assert defaults.eos_token_ids == (2, 9)


def test_folder_mode_without_file_names_the_field(model_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError) as info:
        load_generation_defaults(model_dir, str(empty))
    assert info.value.field == "generation_config"
    with pytest.raises(ConfigError):
        load_generation_defaults(model_dir, str(tmp_path / "missing"))


def test_bad_json_is_a_config_error(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError):
        load_generation_defaults(folder, "auto")

"""Chat templates: SmolLM2's ChatML, caller-given templates, and the errors users can cause."""
import pytest
import torch

from vbatch.engine.errors import ConfigError, InputError, ModelLoadError
from vbatch.engine.tokenizer import apply_chat_template, load_tokenizer

torch.set_num_threads(1)

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tok")
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")),
                                  unk_token="[UNK]")
    tok.save_pretrained(str(folder))
    return load_tokenizer(folder)


def _render(tok, conversation, **kw):
    args = dict(chat_template=None, add_generation_prompt=True, continue_final_message=False)
    args.update(kw)
    return apply_chat_template(tok, conversation, **args)


def test_no_template_is_a_config_error_with_hint(tiny_tokenizer):
    with pytest.raises(ConfigError) as info:
        _render(tiny_tokenizer, [{"role": "user", "content": "hi"}])
    assert info.value.field == "chat_template" and info.value.hint


def test_caller_template_text_and_file(tiny_tokenizer, tmp_path):
    conv = [{"role": "user", "content": "hi"}]
    assert _render(tiny_tokenizer, conv, chat_template=TEMPLATE) == "[user]hi[assistant]"
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert _render(tiny_tokenizer, conv, chat_template=str(tmp_path / "t.jinja"),
                   add_generation_prompt=False) == "[user]hi"
    with pytest.raises(ConfigError):
        _render(tiny_tokenizer, conv, chat_template=str(tmp_path / "missing.jinja"))


def test_text_parts_are_joined_for_string_templates(tiny_tokenizer):
    conv = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert _render(tiny_tokenizer, conv, chat_template=TEMPLATE) == "[user]a\nb[assistant]"


def test_both_generation_flags_is_a_config_error(tiny_tokenizer):
    with pytest.raises(ConfigError):
        _render(tiny_tokenizer, [{"role": "user", "content": "hi"}], chat_template=TEMPLATE,
                continue_final_message=True)


def test_template_exception_is_an_input_error(tiny_tokenizer):
    template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InputError, match="roles must alternate"):
        _render(tiny_tokenizer, [{"role": "user", "content": "hi"}], chat_template=template)


def test_missing_tokenizer_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError):
        load_tokenizer(tmp_path)


@pytest.mark.slow
def test_smollm2_renders_chatml(smollm2_path):
    tok = load_tokenizer(smollm2_path)
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    expected = (f"<|im_start|>system\n{system}<|im_end|>\n"
                "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    assert _render(tok, conv) == expected
    continued = _render(tok, conv + [{"role": "assistant", "content": "The capital"}],
                        add_generation_prompt=False, continue_final_message=True)
    assert continued.endswith("<|im_start|>assistant\nThe capital")
    assert tok.eos_token == "<|im_end|>"

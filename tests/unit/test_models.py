"""Base-model loading: names, local directories, SmolLM2 conversion cache."""

from __future__ import annotations

import pytest
import torch

from loraplane.errors import InvalidArgument, NotFound
from loraplane.models import SMOLLM2_NAME, load_base_model


def test_tiny_describes_itself():
    base = load_base_model("tiny")
    assert base.num_layers == 2 and base.hidden_size == 64
    assert base.module_dims["k_proj"] == (64, 32) and base.module_dims["down_proj"] == (128, 64)
    assert base.eos_token_ids == [base.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert base.max_context_length == 512
    ids = base.tokenizer("hello")["input_ids"]
    assert base.tokenizer.decode(ids) == "hello"
    assert b'"model"' in base.tokenizer_json()
    assert "<|im_start|>" in base.chat_template


def test_local_directory_roundtrip(tmp_path):
    base = load_base_model("tiny")
    base.model.save_pretrained(tmp_path)
    base.tokenizer.save_pretrained(tmp_path)
    again = load_base_model(str(tmp_path))
    tokens = torch.tensor([[1, 50, 60, 70, 80]])
    with torch.no_grad():
        assert torch.equal(base.model(tokens).logits, again.model(tokens).logits)
    assert again.tokenizer("abc")["input_ids"] == base.tokenizer("abc")["input_ids"]


def test_unknown_names_are_rejected():
    with pytest.raises(NotFound) as info:
        load_base_model("no-such-model")
    assert info.value.field == "base_model"
    with pytest.raises(InvalidArgument):
        load_base_model("")


@pytest.mark.slow
def test_smollm2_converts_once_and_answers(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLANE_MODEL_CACHE", str(tmp_path))
    base = load_base_model(SMOLLM2_NAME)
    assert (tmp_path / SMOLLM2_NAME / "model.safetensors").is_file()
    assert base.vocab_size == 49152 and base.num_layers == 30 and base.hidden_size == 576
    again = load_base_model(SMOLLM2_NAME)  # from the cache
    prompt = base.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True)["input_ids"]
    out = again.model.generate(prompt, max_new_tokens=10, do_sample=False)
    assert "Paris" in again.tokenizer.decode(out[0, prompt.shape[1]:])

"""The offline cookbook environment (tests/gateway/cookbook_env.py) for gpt-oss and Nemotron-3: tiny random
checkpoints of each family (transformers' own classes, the families' tiny configs over a fixture vocabulary) to be
served under the cookbook's own model names, and fixture tokenizers in the offline HF cache under those names.

- gpt-oss (`openai/gpt-oss-20b`, the cookbook's renderer gpt_oss_no_sysprompt: Harmony): a byte-level BPE with a
  small vocabulary learnt from the recipes' rows plus the Harmony markers (<|start|>, <|message|>, <|channel|>,
  <|end|>, <|return|>, <|call|>, <|constrain|>) as single tokens, <|return|> as EOS;
- Nemotron-3 (`nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16`, renderer nemotron3, which builds on the cookbook's
  Qwen3.5 renderer: ChatML, <think>, XML tool calls): cookbook_env's Qwen3.5 fixture tokenizer, which has exactly
  those added tokens.

Token ids differ from the real tokenizers'; what the renderers rely on (each marker one token) holds."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tests.gateway.cookbook_env import (
    byte_level_bpe_tokenizer,
    cached_repo,
    hf_home,
    qwen3_5_tokenizer,
)

GPT_OSS_MODEL = "openai/gpt-oss-20b"
NEMOTRON3_MODEL = "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"
GPT_OSS_ADDED_TOKENS = ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|message|>", "<|channel|>", "<|end|>",
                        "<|return|>", "<|call|>", "<|constrain|>")
# Harmony, enough for the gateway's chat routes (the cookbook renders by itself).
_GPT_OSS_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|start|>' + message['role'] + '<|message|>' + message['content'] }}"
    "{{- '<|end|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}")


def gpt_oss_tokenizer(target: Path) -> Path:
    return byte_level_bpe_tokenizer(
        target, "system user assistant analysis final commentary Reasoning: medium Knowledge cutoff Current date",
        eos_token="<|return|>", chat_template=_GPT_OSS_CHAT_TEMPLATE, added_tokens=GPT_OSS_ADDED_TOKENS,
        special=GPT_OSS_ADDED_TOKENS)


def random_family_model(model_type: str, target: Path, tokenizer_dir: Path) -> Path:
    """A tiny random checkpoint of `model_type` (its family's tiny config) over the fixture tokenizer's vocabulary,
    saved as transformers writes the family (Nemotron-H: backbone.*), with the tokenizer beside it."""
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraplane.models import families

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = families.FAMILIES[model_type].tiny_config(len(tokenizer))
    config.eos_token_id, config.pad_token_id, config.bos_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id, None
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(target), safe_serialization=True)
    for name in os.listdir(tokenizer_dir):
        shutil.copy2(tokenizer_dir / name, target / name)
    return target


def prepare_families(root: Path) -> dict[str, str]:
    """Both checkpoints and one HF_HOME (the recipes' datasets, each fixture tokenizer under its cookbook name)."""
    oss_tokenizer = gpt_oss_tokenizer(root / "gpt_oss-tokenizer")
    nemotron_tokenizer = qwen3_5_tokenizer(root / "nemotron3-tokenizer")
    home = hf_home(root, oss_tokenizer, (GPT_OSS_MODEL,))
    cached_repo(home, NEMOTRON3_MODEL, nemotron_tokenizer)
    return {"gpt_oss_dir": str(random_family_model("gpt_oss", root / "gpt_oss-random", oss_tokenizer)),
            "nemotron_dir": str(random_family_model("nemotron_h", root / "nemotron3-random", nemotron_tokenizer)),
            "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

"""The `tiny` base model: a seeded random Llama-architecture model with a byte-level tokenizer, built offline.

Every weight comes from one CPU torch.Generator (uniform draws, which are bit-identical across CPUs for a given
torch version) in a fixed parameter order, so the model is the same on every machine and independent of the global
RNG. The shape is small enough for fast unit tests but keeps GQA (4 query heads over 2 KV heads) so the grouped
attention paths of both engines are exercised.
"""

from __future__ import annotations

import math

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TINY_SEED = 20240611
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MAX_CONTEXT = 512


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: ids 0..4 are the special tokens, then one token per byte (no merges)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of_char()[ch])
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in byte_chars:
        vocab[ch] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        model_max_length=MAX_CONTEXT,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _byte_of_char() -> dict[str, int]:
    # GPT-2's byte -> printable unicode mapping, inverted (the order ByteLevel uses).
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def tiny_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=MAX_CONTEXT,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_id=4,
        pad_token_id=0,
    )


def build_tp_divisible_llama(seed: int) -> LlamaForCausalLM:
    """A seeded tiny Llama (fp32) whose vocabulary (256), heads (4) and KV heads (2) split over 2 tensor-parallel
    ranks; the stock `tiny` model's 261-token vocabulary does not. Its tokenizer is :func:`build_tiny_tokenizer`."""
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, max_position_embeddings=256)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def build_tiny_model(vocab_size: int) -> LlamaForCausalLM:
    config = tiny_config(vocab_size)
    model = LlamaForCausalLM(config)
    generator = torch.Generator(device="cpu").manual_seed(TINY_SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                # Around 1 rather than exactly 1 so a norm bug cannot hide behind an identity.
                values = 1.0 + 0.1 * (torch.rand(param.shape, generator=generator, dtype=torch.float32) - 0.5)
            else:
                fan_in = param.shape[-1]
                # Uniform with std 1/sqrt(fan_in) (embeddings: std 1) keeps activations O(1) so logits are far
                # from uniform and LoRA updates visibly move them.
                bound = math.sqrt(3.0) * (1.0 if "embed_tokens" in name else 1.0 / math.sqrt(fan_in))
                values = (torch.rand(param.shape, generator=generator, dtype=torch.float32) * 2.0 - 1.0) * bound
            param.copy_(values)
    return model


TINY_MOE_NAME = "tiny-moe"
TINY_MOE_SEED = 20261126


def tiny_moe_config(vocab_size: int):
    """A Qwen3-MoE in miniature: layer 0 dense (mlp_only_layers), layers 1-2 MoE with 8 experts top-2 and
    renormalised top-k weights, GQA (4 query heads over 2 KV heads), per-head q/k RMSNorm, head_dim != hidden/heads.
    Sizes are multiples of 4 so every fp32 grouped matmul operand meets torch._grouped_mm's 16-byte strides."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        max_position_embeddings=MAX_CONTEXT,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        router_aux_loss_coef=0.0,
        bos_token_id=1,
        eos_token_id=4,
        pad_token_id=0,
    )


def build_tiny_moe_model(vocab_size: int):
    """The seeded `tiny-moe` model (fp32), every weight from one CPU generator like `tiny`. The router weights are
    drawn larger than the rest so that routing is decisive (top-k ties would make tests fragile)."""
    from transformers import Qwen3MoeForCausalLM

    config = tiny_moe_config(vocab_size)
    model = Qwen3MoeForCausalLM(config)
    generator = torch.Generator(device="cpu").manual_seed(TINY_MOE_SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * (torch.rand(param.shape, generator=generator, dtype=torch.float32) - 0.5)
            else:
                fan_in = param.shape[-1]
                bound = math.sqrt(3.0) * (1.0 if "embed_tokens" in name else 1.0 / math.sqrt(fan_in))
                if name.endswith("mlp.gate.weight"):
                    bound *= 4.0
                values = (torch.rand(param.shape, generator=generator, dtype=torch.float32) * 2.0 - 1.0) * bound
            param.copy_(values)
    return model

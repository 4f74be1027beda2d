"""Text-only Qwen3.5 checkpoints (architectures Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM) with LoRA.

SGLang 0.5.17 serves LoRA on Qwen3.5 through its vision-language classes only: its text-only wrapper
(sglang/srt/models/qwen3_5_text.py) lacks the get_hidden_dim the LoRA memory pool sizes its buffers with, so a server
with --enable-lora dies at start-up ("get_hidden_dim not implemented for in_proj_qkvz"). The wrapped decoder has it;
these classes answer as SGLang's vision-language classes do (their language model is the same decoder)."""

from __future__ import annotations

from sglang.srt.models import qwen3_5_text


class _LoraHooks:
    def get_hidden_dim(self, module_name: str, layer_idx: int):
        return self.model.get_hidden_dim(module_name, layer_idx)

    def should_apply_lora(self, module_name: str) -> bool:
        return module_name.startswith("model.layers.")


class Qwen3_5ForCausalLM(_LoraHooks, qwen3_5_text.Qwen3_5ForCausalLM):
    pass


class Qwen3_5MoeForCausalLM(_LoraHooks, qwen3_5_text.Qwen3_5MoeForCausalLM):
    pass


EntryClass = [Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM]

"""HF parameter names shared by the Llama-layout families (text-only causal LM naming; {i} = layer index)."""

COMMON_WEIGHTS = {
    "embed_tokens": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",  # absent when tie_word_embeddings
    "input_layernorm": "model.layers.{i}.input_layernorm.weight",
    "post_attention_layernorm": "model.layers.{i}.post_attention_layernorm.weight",
    "q_proj": "model.layers.{i}.self_attn.q_proj.weight",
    "k_proj": "model.layers.{i}.self_attn.k_proj.weight",
    "v_proj": "model.layers.{i}.self_attn.v_proj.weight",
    "o_proj": "model.layers.{i}.self_attn.o_proj.weight",
}
DENSE_MLP_WEIGHTS = {
    "gate_proj": "model.layers.{i}.mlp.gate_proj.weight",
    "up_proj": "model.layers.{i}.mlp.up_proj.weight",
    "down_proj": "model.layers.{i}.mlp.down_proj.weight",
}
QKV_BIAS_WEIGHTS = {
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
}
QK_NORM_WEIGHTS = {
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",  # [head_dim], shared by every head
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
}
EXPERT_WEIGHTS = {
    # [num_experts, hidden]: router logits = x W^T; softmax in fp32, top-k, optional renormalisation.
    "router": "model.layers.{i}.mlp.gate.weight",
    # [num_experts, 2 * moe_intermediate_size, hidden]: rows [0, ffn) are gate, [ffn, 2 ffn) up.
    "experts.gate_up_proj": "model.layers.{i}.mlp.experts.gate_up_proj",
    # [num_experts, hidden, moe_intermediate_size]
    "experts.down_proj": "model.layers.{i}.mlp.experts.down_proj",
}

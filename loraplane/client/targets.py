"""Tinker's LoraConfig flags (train_attn / train_mlp) as LoRA targets of the base model's family.

"Attention" is the model's token mixer, whatever its kind: softmax attention (``q_proj``.., Nemotron-H's
``mixer.q_proj``..), Qwen3.5's linear-attention projections and Nemotron-H's Mamba mixers (``mixer.in_proj``,
``mixer.out_proj``). "MLP" is what the model has after it: a dense model's gate/up/down, Nemotron-H's relu^2
``mixer.up_proj|down_proj``, a MoE model's shared and routed experts. The group of each target is the family
registry's (loraplane.models.families TARGETS); the trainer's GetInfo names the targets a base model offers.
"""

from __future__ import annotations

from collections.abc import Iterable

# Every registry group that is a token mixer; every other group is an MLP part.
MIXER_GROUPS = frozenset({"attention", "linear_attention", "mamba", "block_attention"})
# What a trainer too old to list its targets offers (a dense Llama-style model).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_mixer_target(name: str) -> bool:
    # Imported here: the registry module pulls torch in, which a process that never narrows (the gateway's
    # default train_attn = train_mlp = True) should not pay for.
    from loraplane.models.families.base import TARGETS

    target = TARGETS.get(name)
    if target is None:  # a name the registry does not know: judged by the dense families' attention names
        return name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj")
    return target.group in MIXER_GROUPS


def narrow_targets(offered: Iterable[str], *, train_attn: bool, train_mlp: bool) -> list[str]:
    """The offered targets (canonical order kept) that the flags select."""
    offered = list(offered) or list(DEFAULT_TARGETS)
    if train_attn and train_mlp:
        return offered
    return [t for t in offered if (train_attn if is_mixer_target(t) else train_mlp)]


# The routed gated experts' targets (loraplane.models.families EXPERT_TARGETS; a unit test keeps them equal), named
# here so that a process deciding a layout does not import torch.
GATED_EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")


def tinker_expert_layout(targets: Iterable[str]) -> str:
    """The expert layout Tinker trains an adapter on these targets in: shared-outer (the hidden side's factor shared
    by a layer's experts; tinker-cookbook's hyperparam_utils.get_lora_param_count counts MoE adapters so) when they
    include routed gated experts, else "" (no experts: no layout)."""
    return "shared_outer" if any(t in GATED_EXPERT_TARGETS for t in targets) else ""

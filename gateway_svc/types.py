"""Plain domain types the gateway's services exchange with upstream.py (which alone touches the gRPC stubs)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DatumIn:
    input_tokens: list[int]
    target_tokens: list[int]  # N values, or N * K row-major when targets_per_position = K
    weights: list[float] | None = None
    logprobs: list[float] | None = None
    advantages: list[float] | None = None
    sequence_ratio_mask: list[float] | None = None
    # Provenance (Tinker's Datum.model_input_spans / loss_fn_input_spans), gateway_svc.stability.Span runs.
    input_spans: list | None = None
    target_spans: list | None = None
    # K of (N, K) soft-target target_tokens / weights (cross_entropy); 0: 1-D, as the SDK sent them.
    targets_per_position: int = 0


@dataclass
class FwdBwdResult:
    logprobs: list[list[float]]
    elementwise_loss: list[list[float]]
    metrics: dict[str, float]


@dataclass
class VersionInfo:
    adapter: str
    version: int
    sha256: str = ""
    size_bytes: int = 0
    training_step: int = 0
    create_time: float = 0.0
    kind: str = "weights"  # weights | training_state
    aliases: list[str] = field(default_factory=list)


@dataclass
class AdapterInfo:
    name: str
    rank: int
    alpha: float
    base_model: str
    latest_version: int = 0
    aliases: dict[str, int] = field(default_factory=dict)
    create_time: float = 0.0
    # A MoE adapter's "per_expert" or "shared_outer"; "" for a dense one.
    expert_layout: str = ""


@dataclass
class SamplingSpec:
    max_tokens: int = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class SampledSeq:
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


@dataclass
class SampleResult:
    sequences: list[SampledSeq]
    prompt_logprobs: list[float] | None
    served_version: int
    # Top-k prompt logprobs, dense row-major (len(prompt), topk_k); empty cells token 0 / logprob -99999.
    topk_k: int = 0
    topk_token_ids: list[int] = field(default_factory=list)
    topk_logprobs: list[float] = field(default_factory=list)
    # target_prompt_logprobs: {"shape": [rows, k], "values": [...], "crow": [...] | None, "col": [...] | None} (CSR
    # when the request was sparse, else dense row-major with 0.0 where nothing was asked).
    target_prompt: dict | None = None


@dataclass
class StreamDelta:
    index: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None


@dataclass
class ServerInfo:
    base_model: str
    max_context_length: int
    max_lora_rank: int
    supported_losses: list[str]
    eos_token_ids: list[int]
    tokenizer_name: str
    # The LoRA targets the base model offers (the trainer's GetInfo): dense MLP projections or routed experts.
    target_modules: list[str] = field(default_factory=list)

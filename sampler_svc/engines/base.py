"""The interface every sampling engine implements (in-process torch, SGLang over HTTP).

The adapter manager decides which adapter versions exist; an engine only loads what it is told to load, under the
name it is given (`<adapter>@v<N>`), and serves requests that name a loaded version or the base model (None).
"""

from __future__ import annotations

import abc
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class SamplingOptions:
    """Validated sampling controls.

    `temperature == 0` is greedy decoding. `top_k <= 0` and `top_p == 1` switch those filters off. The logprob an
    engine reports for a sampled token is always taken from the UNMODIFIED model distribution (temperature 1, no
    top-k/top-p filtering), whatever the sampling temperature: it is then directly comparable with the trainer's
    Forward logprobs of the same tokens, which is what importance-sampling / PPO losses need as `q`. (The
    probability the token was actually drawn with is a different number unless temperature is 1 and no filter is on.)

    Stopping: a sequence ends after the token that is a stop token id or an end-of-sequence token of the base model,
    or that completes a stop string; that token is included in the output.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    # Benchmarks only (not in the contract): keep generating through end-of-sequence tokens.
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerationRequest:
    prompt_tokens: tuple[int, ...]
    options: SamplingOptions = field(default_factory=SamplingOptions)
    num_samples: int = 1
    # Engine-level adapter name (`<adapter>@v<N>`) or None for the base model.
    adapter_key: str | None = None
    include_prompt_logprobs: bool = False
    # k > 0: the k most likely tokens and their logprobs at every scored prompt position (TopkRows).
    topk_prompt_logprobs: int = 0
    # n > 0: score only the last n prompt tokens (prompt logprobs and top-k); earlier positions are NaN / empty.
    prompt_logprobs_last_n: int = 0
    # The caller forwards tokens as they are produced (SampleStream); otherwise it only wants the whole result,
    # which an engine may fetch in one piece.
    stream: bool = False


    @property
    def wants_prompt_scores(self) -> bool:
        return self.include_prompt_logprobs or self.topk_prompt_logprobs > 0

    @property
    def first_scored_position(self) -> int:
        """Prompt position of the first scored token (position 0 has no context, so never scored)."""
        n = len(self.prompt_tokens)
        return max(1, n - self.prompt_logprobs_last_n) if self.prompt_logprobs_last_n else 1


# An empty top-k cell, as the Tinker SDK writes it (tinker.types.topk_logprobs).
TOPK_EMPTY_TOKEN = 0
TOPK_EMPTY_LOGPROB = -99999.0


@dataclass
class TopkRows:
    """Top-k prompt logprobs, one row of k per prompt position (len(prompt) rows), most likely first. Rows of
    positions that were not scored (position 0, those before prompt_logprobs_last_n) hold empty cells."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]

    @classmethod
    def empty(cls, length: int, k: int) -> TopkRows:
        return cls([[TOPK_EMPTY_TOKEN] * k for _ in range(length)], [[TOPK_EMPTY_LOGPROB] * k for _ in range(length)])


FINISH_LENGTH = "length"
FINISH_STOP = "stop"


@dataclass
class GenerationUpdate:
    """New tokens of one sequence since its previous update; `finish_reason` is set on its last update.
    `prompt_logprobs` / `topk_prompt` are set (once, on some update) when the request asked for them; entry 0 is
    NaN / an empty row, as are the positions before prompt_logprobs_last_n."""

    sequence_index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[float] | None = None
    topk_prompt: TopkRows | None = None


@dataclass(frozen=True)
class LoadedAdapterInfo:
    key: str
    rank: int


class Engine(abc.ABC):
    """A sampling engine. All methods are called from the asyncio loop of the sampler."""

    name: str = "engine"

    @property
    @abc.abstractmethod
    def base_model_name(self) -> str: ...

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def max_context_length(self) -> int: ...

    @property
    def supports_stop_strings(self) -> bool:
        return True

    async def start(self) -> None:
        """Brings the engine up (loads the model, starts workers or servers)."""

    async def stop(self) -> None:
        """Releases everything `start` acquired."""

    @abc.abstractmethod
    async def load_adapter(self, key: str, blob: bytes) -> LoadedAdapterInfo:
        """Loads a PEFT safetensors adapter blob under `key`. Raises InvalidArgument / FailedPrecondition when the
        blob does not fit the base model."""

    @abc.abstractmethod
    async def unload_adapter(self, key: str) -> None:
        """Forgets `key`. The manager calls it only when no request holds the version."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        """Streams updates until every sample has finished. Closing the iterator early cancels the request."""

    @abc.abstractmethod
    async def compute_logprobs(self, tokens: Sequence[int], adapter_key: str | None) -> list[float]:
        """logprob of tokens[i] given tokens[:i]; entry 0 is NaN."""

    @property
    def queue_depth(self) -> int:
        return 0

    @property
    def running_requests(self) -> int:
        return 0

    @property
    def server_urls(self) -> list[str]:
        """URLs of the inference servers this engine drives (empty for an in-process engine)."""
        return []


def nan_first(values: Sequence[float]) -> list[float]:
    return [math.nan, *values]

"""The shapes of the Tinker wire's JSON bodies, checked where a request enters the gateway.

Every field the SDK can send gets its type and range here (pydantic models, one per route), so a body of the wrong
shape or a number the services' protobufs cannot carry (tokens are int32, max_tokens uint32, seeds uint64) is a 400
naming the field before anything is recorded or run, and never reaches the service code as a TypeError / ValueError
(a 500, or a future failing with category `unknown`).

Sequenced training requests (optim_step, save_weights, ...) are checked here only for what routes them (model_id,
seq_id): the rest of their content is checked inside their future, which spends the seq_id on the trainer when it
refuses (a 400 here would leave the model waiting on that seq_id). Unknown fields are kept and ignored, as the SDK
adds fields between releases."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loraplane import errors

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1

# Integers are strict (a JSON true or 1.5 is not a count); floats must be finite (JSON parses 1e400 as inf).
Int32 = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]
Token = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]
Positive32 = Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)]
SeqId = Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)]  # the SDK's own wire carries it as int32
Seed = Annotated[int, Field(strict=True, ge=0, le=UINT64_MAX)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Id = Annotated[str, Field(max_length=512)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class Chunk(_Body):
    type: str = "encoded_text"
    tokens: list[Token] | None = None


class ModelInput(_Body):
    chunks: list[Chunk] = []


class SamplingParams(_Body):
    max_tokens: Int32 | None = None  # 0 = the gateway's default
    temperature: Annotated[Finite, Field(ge=0)] | None = None
    top_p: Annotated[Finite, Field(ge=0)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1, le=INT32_MAX)] | None = None
    seed: Seed | None = None
    # Strings or token ids: checked by the service (a union here would name a union member, not the field).
    stop: Any = None


class Sample(_Body):
    sampling_session_id: Id | None = None
    # Only a dedup key (never sent to a service): any int64, as the SDK may count past int32.
    seq_id: Annotated[int, Field(strict=True, ge=0, le=2**63 - 1)] | None = None
    num_samples: Positive32 | None = None
    prompt: ModelInput = ModelInput()
    sampling_params: SamplingParams = SamplingParams()
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: Int32 | None = None
    prompt_logprobs_last_n: Int32 | None = None
    record_stability_info: bool | None = None
    # Checked by the service (TensorData, dense or CSR), which also range-checks its token ids.
    target_prompt_logprobs: dict[str, Any] | None = None


class SessionRef(_Body):
    session_id: Id = ""


class CreateSession(_Body):
    tags: list[str] | None = None
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None


class Lora(_Body):
    rank: Positive32 | None = None
    seed: Seed | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None
    train_unembed: bool | None = None


class CreateModel(_Body):
    session_id: Id = ""
    model_seq_id: Int32 = 0
    base_model: str | None = None
    lora_config: Lora | None = None
    optimizer_config: dict[str, Any] | None = None
    user_metadata: dict[str, Any] | None = None


class ModelRef(_Body):
    model_id: Id = ""


class Sequenced(_Body):
    """optim_step, save_weights, save_weights_for_sampler, save_weights_external: routing fields only (the rest is
    checked in the future, which spends the seq_id when it refuses)."""

    model_id: Id = ""
    seq_id: SeqId | None = None


class LoadWeights(_Body):
    model_id: Id | None = None
    seq_id: SeqId | None = None
    session_id: Id | None = None
    model_seq_id: Int32 = 0
    path: Id | None = ""
    optimizer: bool | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None


class CreateSamplingSession(_Body):
    session_id: Id = ""
    sampling_session_seq_id: Int32 | None = None
    base_model: str | None = None
    model_path: Id | None = None


class RequestRef(_Body):
    request_id: Id = ""


class FinishSession(_Body):
    reason: Any = None


class CheckpointTtl(_Body):
    ttl_seconds: Positive32 | None = None


class WeightsInfo(_Body):
    tinker_path: Id = ""


def checked(model: type[_Body], body: dict[str, Any]) -> dict[str, Any]:
    """`body` validated by `model`, as the plain dict the service reads (only the fields the caller sent, plus the
    unknown ones kept as sent); InvalidArgument naming the first offending field otherwise."""
    try:
        return model.model_validate(body).model_dump(exclude_unset=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        value = first.get("input")
        raise errors.InvalidArgument(f"{where} {errors.shown(value)}: {first.get('msg', 'invalid')}",
                                     field=where) from None

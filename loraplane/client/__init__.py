"""loraplane's Python client: a Tinker-style SDK over the gRPC services.

    from loraplane.client import ServiceClient, Datum, ModelInput, AdamParams, SamplingParams

    service = ServiceClient()                      # addresses from LORAPLANE_*_ADDRESS or `loraplane up`
    training = service.create_lora_training_client("tiny", rank=8)
    fb = training.forward_backward(data, "cross_entropy")   # returns at once
    step = training.optim_step(AdamParams(learning_rate=1e-3))  # pipelined behind fb
    print(fb.result().metrics, step.result().step)
    sampler = training.save_weights_for_sampler().result()  # a SamplingClient pinned to the new version
    print(sampler.sample(ModelInput.from_ints(prompt), 2, SamplingParams(max_tokens=20)).result())
"""

from loraplane.client._runtime import NO_RETRY, RetryConfig
from loraplane.client.chunking import merge_metrics, split_into_chunks
from loraplane.client.errors import (
    AbortedError,
    AlreadyExistsError,
    APIError,
    CancelledError,
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from loraplane.client.futures import APIFuture
from loraplane.client.sampling_client import SamplingClient
from loraplane.client.service_client import ServiceClient
from loraplane.client.training_client import TrainingClient
from loraplane.client.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoadStateResponse,
    ModelInput,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveStateResponse,
    TensorData,
    TrainerAdapterInfo,
    VersionInfo,
    datum_from_sequence,
    format_path,
    parse_path,
)

__all__ = [
    "NO_RETRY",
    "APIError",
    "APIFuture",
    "AbortedError",
    "AdamParams",
    "AlreadyExistsError",
    "CancelledError",
    "DataLossError",
    "Datum",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "ForwardBackwardOutput",
    "InternalError",
    "InvalidArgumentError",
    "LoadStateResponse",
    "ModelInput",
    "NotFoundError",
    "OptimStepResponse",
    "ResourceExhaustedError",
    "RetryConfig",
    "SampleResponse",
    "SampledSequence",
    "SamplingClient",
    "SamplingParams",
    "SaveStateResponse",
    "ServiceClient",
    "TensorData",
    "TrainerAdapterInfo",
    "TrainingClient",
    "UnavailableError",
    "VersionInfo",
    "datum_from_sequence",
    "format_path",
    "merge_metrics",
    "parse_path",
    "split_into_chunks",
]

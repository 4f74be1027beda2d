"""The trainer's GetInfo and the base model's tokenizer, built from GetInfo(include_tokenizer=true): no model hub.
Shared by every client (training, sampling, service) and cached per process."""

from __future__ import annotations

import threading
from typing import Any

from loraplane.client._runtime import RetryConfig, call_with_retry, runtime
from loraplane.v1 import trainer_pb2, trainer_pb2_grpc

_tokenizers: dict[tuple[str, str, int], Any] = {}
_tokenizers_lock = threading.Lock()


def tokenizer_from_info(info: trainer_pb2.TokenizerInfo):
    """A transformers.PreTrainedTokenizerFast with the server's special tokens and chat template."""
    if not info.tokenizer_json:
        raise ValueError(f"tokenizer info of {info.name or 'the base model'} carries no tokenizer.json "
                         "(ask GetInfo with include_tokenizer=true)")
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(info.tokenizer_json.decode("utf-8"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    vocab = backend.get_vocab_size(with_added_tokens=True)

    def token_of(token_id: int) -> str | None:
        return backend.id_to_token(token_id) if 0 <= token_id < vocab else None

    if info.eos_token_ids and (eos := token_of(info.eos_token_ids[0])) is not None:
        tokenizer.eos_token = eos
    if info.bos_token_id >= 0 and (bos := token_of(info.bos_token_id)) is not None:
        tokenizer.bos_token = bos
    if info.pad_token_id >= 0 and (pad := token_of(info.pad_token_id)) is not None:
        tokenizer.pad_token = pad
    if info.chat_template:
        tokenizer.chat_template = info.chat_template
    tokenizer.name_or_path = info.name
    return tokenizer


async def get_server_info(trainer_address: str, include_tokenizer: bool, retry: RetryConfig
                    ) -> trainer_pb2.GetInfoResponse:
    stub = trainer_pb2_grpc.TrainerServiceStub(runtime().channel(trainer_address))
    request = trainer_pb2.GetInfoRequest(include_tokenizer=include_tokenizer)
    return await call_with_retry(lambda timeout: stub.GetInfo(request, timeout=timeout), retry, method="GetInfo",
                                 address=trainer_address)


def fetch_tokenizer(trainer_address: str, retry: RetryConfig | None = None):
    """The trainer base model's tokenizer. Built once per (trainer, base model): a cheap GetInfo first tells whether
    the cached one still fits the server now at that address."""
    retry = retry or RetryConfig()
    info = runtime().run(get_server_info(trainer_address, False, retry))
    key = (trainer_address, info.base_model, info.tokenizer.vocab_size)
    with _tokenizers_lock:
        if key not in _tokenizers:
            full = runtime().run(get_server_info(trainer_address, True, retry))
            _tokenizers[key] = tokenizer_from_info(full.tokenizer)
        return _tokenizers[key]

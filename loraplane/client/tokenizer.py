"""Builds a Hugging Face fast tokenizer from the trainer's GetInfo(include_tokenizer=true) reply: no model hub."""

from __future__ import annotations

from loraplane.v1 import trainer_pb2


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

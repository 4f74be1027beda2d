"""The gateway's streamed text (gateway_svc/openai_service.IncrementalText): decoded a few tokens at a time, it is the
whole token list's decode at every step it releases, for a byte-level tokenizer (`tiny`: characters split over
tokens) and a SentencePiece-style one (Metaspace: the first token of a window loses its leading space), with
special tokens (skipped) anywhere and tokens arriving one or several at a time."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gateway_svc.openai_service import IncrementalText, cut_at_stop, stop_prefix_length
from loraplane.models import load_base_model

TEXT = ("Grüße aus Köln: 你好世界 🎉🚀 — naïve café, ½ + ¾ = 1¼. The end of the line\n"
        "second line: über ünïcödé and plain ascii words, words, words.")


def tiny_tokenizer():
    return load_base_model("tiny").tokenizer


def metaspace_tokenizer():
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=len(set(TEXT)) + 40, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=sorted(set(TEXT)))
    tokenizer.train_from_iterator([TEXT] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>")


@pytest.mark.parametrize("make", [tiny_tokenizer, metaspace_tokenizer], ids=["byte-level", "metaspace"])
def test_released_text_is_the_whole_decode_at_every_step(make):
    tokenizer = make()
    special = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    rng = random.Random(7)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 40
    for trial in range(12):
        tokens = list(ids)
        for _ in range(4):  # special tokens mid-stream decode to nothing
            tokens.insert(rng.randrange(len(tokens) + 1), special)
        if trial % 3 == 2:  # and random ids: bytes that never form a character
            tokens += [rng.randrange(len(tokenizer)) for _ in range(30)]
        incremental = IncrementalText(tokenizer)
        released = held = 0
        i = 0
        while i < len(tokens):
            step = rng.choice((1, 1, 2, 3))
            chunk, i = tokens[i:i + step], i + step
            final = i >= len(tokens)
            whole = tokenizer.decode(tokens[:i], skip_special_tokens=True)
            if incremental.add(chunk, final=final):
                released += 1
                assert incremental.text == whole
            else:
                held += 1
                assert whole.endswith("\ufffd")  # only a character still missing bytes holds the text back
        assert incremental.text == tokenizer.decode(tokens, skip_special_tokens=True)
        assert released > 0
    if make is tiny_tokenizer:
        assert held > 0  # the byte tokenizer did split characters: the hold-back was exercised


def test_stop_strings_are_found_where_new_text_can_complete_them():
    assert cut_at_stop("abc STOP def", ["STOP"]) == ("abc ", True)
    assert cut_at_stop("abc STOP def", ["STOP"], start=3) == ("abc ", True)  # a match starting at the search start
    assert cut_at_stop("abc STOP def", ["STOP"], start=5) == ("abc STOP def", False)
    assert cut_at_stop("abc", []) == ("abc", False)


def test_a_possible_start_of_a_stop_string_is_held_back():
    assert stop_prefix_length("hello wor", ["world!"]) == 3  # "wor" may become "world!"
    assert stop_prefix_length("hello w", ["world!", "wx"]) == 1
    assert stop_prefix_length("hello", ["world!"]) == 0
    assert stop_prefix_length("abcab", ["abcabd"]) == 5  # the longest candidate wins
    assert stop_prefix_length("xa", ["ab"]) == 1
    assert stop_prefix_length("xab", ["ab"]) == 0  # a whole stop string is cut_at_stop's: a match, not a prefix
    assert stop_prefix_length("anything", []) == 0

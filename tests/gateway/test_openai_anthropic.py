"""The official `openai` and `anthropic` Python clients against the gateway's OpenAI-compatible and Anthropic
Messages endpoints, on a real sampler (`tiny` model) with a real published adapter."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.fixtures.sampler import adapter_blob

ADAPTER = "oa/greeter"


@pytest.fixture(scope="module")
def published(cluster):
    cluster.sampler.create_adapter(ADAPTER)
    version = cluster.sampler.publish(ADAPTER, adapter_blob(seed=11, scale=2.0), aliases=["prod"])
    return version.version


@pytest.fixture(scope="module")
def oai(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(cluster):
    return anthropic.Anthropic(base_url=cluster.base_url, api_key="unused", max_retries=0)


def test_models_lists_the_base_model_adapter_versions_and_aliases(oai, published):
    ids = {m.id for m in oai.models.list().data}
    assert {"tiny", ADAPTER, f"{ADAPTER}@v{published}", f"{ADAPTER}@prod"} <= ids


def test_completions(oai, published):
    reply = oai.completions.create(model="tiny", prompt="hello", max_tokens=6, n=2, temperature=1.0, seed=5,
                                   logprobs=1)
    assert len(reply.choices) == 2 and reply.usage.completion_tokens == 12
    for choice in reply.choices:
        assert choice.finish_reason == "length" and len(choice.logprobs.token_logprobs) == 6
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    again = oai.completions.create(model="tiny", prompt="hello", max_tokens=6, n=2, temperature=1.0, seed=5)
    assert [c.text for c in again.choices] == [c.text for c in reply.choices]  # same seed, same text
    # The adapter changes greedy output; an explicit version and an alias name the same weights.
    base = oai.completions.create(model="tiny", prompt=[10, 20, 30, 40], max_tokens=8, temperature=0)
    pinned = oai.completions.create(model=f"{ADAPTER}@v{published}", prompt=[10, 20, 30, 40], max_tokens=8,
                                    temperature=0)
    alias = oai.completions.create(model=f"{ADAPTER}@prod", prompt=[10, 20, 30, 40], max_tokens=8, temperature=0)
    assert pinned.choices[0].text == alias.choices[0].text != base.choices[0].text
    with pytest.raises(openai.NotFoundError) as missing:
        oai.completions.create(model="oa/missing@v3", prompt="x", max_tokens=2)
    assert "oa/missing" in str(missing.value)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="tiny", prompt="x", max_tokens=0)


def test_chat_completions_and_streaming(oai, published):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    reply = oai.chat.completions.create(model=ADAPTER, messages=messages, max_tokens=8, temperature=0,
                                        logprobs=True)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and len(choice.logprobs.content) == reply.usage.completion_tokens
    streamed = oai.chat.completions.create(model=ADAPTER, messages=messages, max_tokens=8, temperature=0,
                                           stream=True)
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    # A stop string ends the text before it.
    full = oai.completions.create(model="tiny", prompt=[10, 20, 30], max_tokens=12, temperature=0).choices[0].text
    stop = full[3:5]
    cut = oai.completions.create(model="tiny", prompt=[10, 20, 30], max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    # Streamed, the text is decoded a few tokens at a time: the same text, cut at the same place; and a long
    # stream (the `tiny` byte tokenizer splits characters over tokens) adds up to the whole reply.
    chunks = list(oai.completions.create(model="tiny", prompt=[10, 20, 30], max_tokens=12, temperature=0,
                                         stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"
    whole = oai.completions.create(model=ADAPTER, prompt=[40, 50], max_tokens=160, temperature=0).choices[0].text
    chunks = list(oai.completions.create(model=ADAPTER, prompt=[40, 50], max_tokens=160, temperature=0,
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole and len(chunks) > 20


def test_anthropic_messages_and_streaming(claude, published):
    message = claude.messages.create(model=f"{ADAPTER}@v{published}", max_tokens=6, system="be brief",
                                     messages=[{"role": "user", "content": "hello"}], extra_body={"temperature": 0})
    assert message.role == "assistant" and message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 6 and message.content[0].type == "text"
    with claude.messages.stream(model=f"{ADAPTER}@v{published}", max_tokens=6, system="be brief",
                                extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
                                ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == message.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 6
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="oa/nothing", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}])
    assert "image" in str(bad.value)

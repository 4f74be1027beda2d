"""OpenAI-compatible (/v1/completions, /v1/chat/completions, /v1/models) and Anthropic Messages (/v1/messages)
sampling on the loraplane sampler. `model` names the base model (any of its served names) or an adapter version:
`<adapter>` (latest), `<adapter>@v<N>` (that exact version) or `<adapter>@<alias>`."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gateway_svc.config import GatewaySettings
from gateway_svc.served_names import ServedNames
from gateway_svc.types import SamplingSpec
from gateway_svc.upstream import Upstream
from loraplane import errors

_VERSION = re.compile(r"^v(\d+)$")


@dataclass
class Target:
    adapter: str
    version: int = 0
    alias: str = ""


@dataclass
class Choice:
    text: str
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str


def cut_at_stop(text: str, stops: list[str], start: int = 0) -> tuple[str, bool]:
    """`text` up to its first stop string, and whether one was found; matches beginning before `start` are not
    looked for (a stream looks only where its new text can complete one)."""
    cut = min((i for i in (text.find(s, start) for s in stops if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def stop_prefix_length(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` could be the start of a stop string: a stream holds them back until
    the next characters show whether they are one (or the stream ends)."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


class IncrementalText:
    """The text of a growing list of sampled tokens, decoding only the newest few each time.

    Decoding the whole list again for every new token costs O(length) per token: 141 µs per token at 2,048 tokens
    with the `tiny` byte tokenizer, which one gateway process pays for every stream it serves. Instead the tokens are
    decoded in a window that starts at the previous step's new tokens (the left context a tokenizer needs: byte-level
    BPE splits characters over tokens, SentencePiece drops the first token's leading space), and the window's text
    beyond its first part's text is what the new tokens add. While the window's text ends inside a character (U+FFFD,
    bytes still to come) nothing is added and the window keeps growing. The same idea as the incremental
    detokenizers of serving engines, written for this gateway."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = 0  # the window's first token: context only, its text is already in self.text
        self._read = 0  # tokens before this one are all in self.text

    def _decode(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=True)

    def add(self, tokens: list[int], final: bool = False) -> bool:
        """Append `tokens`; False while the text would end inside a character (held back until its last byte comes,
        or until `final`)."""
        self.tokens.extend(tokens)
        if self._read == len(self.tokens):
            return True
        before = self._decode(self.tokens[self._prefix:self._read])
        after = self._decode(self.tokens[self._prefix:])
        if after.endswith("\ufffd") and not final:
            return False
        if len(after) <= len(before) and not final:
            return True  # special tokens (skipped) or nothing visible yet: the window keeps them as context
        if after.startswith(before):
            self.text += after[len(before):]
        else:  # a tokenizer that rewrites earlier text (clean-up of spaces): its whole decode is the truth
            self.text = self._decode(self.tokens)
        self._prefix, self._read = self._read, len(self.tokens)
        return True


TinkerPaths = Callable[[str], Awaitable[tuple[str, int]]]


class OpenAIService:
    def __init__(self, settings: GatewaySettings, upstream: Upstream, tinker_paths: TinkerPaths | None = None):
        """`tinker_paths`: resolves a `tinker://<model>/sampler_weights/<name>` path to (adapter, version) within
        the caller's tenant (another tenant's path answers as a missing one)."""
        self.settings = settings
        self.upstream = upstream
        self.tinker_paths = tinker_paths
        self.served = ServedNames(settings, upstream)

    async def base_names(self) -> list[str]:
        return await self.served.names()

    async def resolve(self, model: str) -> Target:
        if not model or model in await self.base_names():
            return Target("")
        if model.startswith("tinker://") and self.tinker_paths is not None:
            adapter, version = await self.tinker_paths(model)
            return Target(adapter, version=version)
        name, _, selector = model.partition("@")
        if not selector:
            return Target(name)
        if m := _VERSION.match(selector):
            return Target(name, version=int(m.group(1)))
        return Target(name, alias=selector)

    async def models(self) -> list[dict[str, Any]]:
        now = int(time.time())
        out = [{"id": n, "object": "model", "created": now, "owned_by": "loraplane"} for n in await self.base_names()]
        for adapter in await self.upstream.list_adapters():
            created = int(adapter.create_time)
            ids = [adapter.name] if adapter.latest_version else []
            ids += [f"{adapter.name}@v{v.version}" for v in await self.upstream.list_versions(adapter.name)
                    if v.kind == "weights"]
            ids += [f"{adapter.name}@{alias}" for alias in sorted(adapter.aliases)]
            out += [{"id": i, "object": "model", "created": created, "owned_by": adapter.name.split("/")[0],
                     "parent": adapter.base_model} for i in ids]
        return out

    async def tokenizer(self):
        return await self.upstream.tokenizer()

    async def encode_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return (await self.tokenizer()).encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise errors.InvalidArgument("prompt: one string or one list of token ids (batched prompts are not "
                                     "supported)", field="prompt")

    async def encode_chat(self, messages: list[dict[str, Any]], system: str | None = None) -> list[int]:
        tokenizer = await self.tokenizer()
        if not messages:
            raise errors.InvalidArgument("messages: at least one message is required", field="messages")
        chat = ([{"role": "system", "content": system}] if system else []) + [
            {"role": m["role"], "content": self.text_of(m.get("content"), "messages")} for m in messages]
        try:
            ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # noqa: BLE001 - the template's own error (unknown role, ...)
            raise errors.InvalidArgument(f"messages: the base model's chat template refused them ({exc})",
                                         field="messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    @staticmethod
    def text_of(content: Any, field: str) -> str:
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            parts = []
            for block in content:
                if not isinstance(block, dict) or block.get("type") != "text":
                    kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                    raise errors.InvalidArgument(f"{field}: content blocks of type {kind!r} are not supported "
                                                 "(text only)", field=field)
                parts.append(block.get("text", ""))
            return "".join(parts)
        raise errors.InvalidArgument(f"{field}: content must be a string or text blocks", field=field)

    def spec(self, *, max_tokens: int | None, temperature: float | None, top_p: float | None, top_k: int | None,
             stop: Any, seed: int | None) -> SamplingSpec:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) for s in stops):
            raise errors.InvalidArgument("stop: a string or a list of strings", field="stop")
        if max_tokens is not None and max_tokens < 1:
            raise errors.InvalidArgument(f"max_tokens {max_tokens}: must be >= 1", field="max_tokens")
        return SamplingSpec(max_tokens=max_tokens or self.settings.default_max_tokens, temperature=temperature,
                            top_p=None if top_p is None or top_p >= 1.0 else top_p, top_k=max(top_k or 0, 0),
                            stop_strings=stops, seed=seed)

    async def generate(self, model: str, prompt: list[int], n: int, spec: SamplingSpec) -> list[Choice]:
        if not 1 <= n <= 64:
            raise errors.InvalidArgument(f"n {n}: must be in [1, 64]", field="n")
        target = await self.resolve(model)
        result = await self.upstream.sample(target.adapter, target.version, prompt, n, spec, False,
                                            alias=target.alias)
        tokenizer = await self.tokenizer()
        choices = []
        for seq in result.sequences:
            text, stopped = cut_at_stop(tokenizer.decode(seq.tokens, skip_special_tokens=True), spec.stop_strings)
            choices.append(Choice(text, seq.tokens, seq.logprobs, "stop" if stopped else seq.finish_reason))
        return choices

    async def stream(self, model: str, prompt: list[int], n: int, spec: SamplingSpec
                     ) -> AsyncIterator[tuple[int, str, list[int], list[float], str | None]]:
        """(choice index, new text, new tokens, their logprobs, finish reason or None) as tokens arrive."""
        if not 1 <= n <= 64:
            raise errors.InvalidArgument(f"n {n}: must be in [1, 64]", field="n")
        target = await self.resolve(model)
        tokenizer = await self.tokenizer()
        texts: dict[int, IncrementalText] = {}
        pending: dict[int, tuple[list[int], list[float]]] = {}
        sent: dict[int, int] = {}  # characters of each choice's text already sent
        longest_stop = max((len(s) for s in spec.stop_strings), default=0)
        done: set[int] = set()
        async for delta in self.upstream.sample_stream(target.adapter, target.version, prompt, n, spec,
                                                      alias=target.alias):
            if delta.index in done:
                continue
            new_tokens, new_lps = pending.setdefault(delta.index, ([], []))
            new_tokens.extend(delta.tokens)
            new_lps.extend(delta.logprobs)
            incremental = texts.setdefault(delta.index, IncrementalText(tokenizer))
            # A partial multi-byte character is held back (its tokens with it) until its last byte arrives.
            if not incremental.add(delta.tokens, final=delta.finish_reason is not None):
                continue
            # The text sent so far held no stop string: a new one ends in the new text.
            before = sent.get(delta.index, 0)
            text, stopped = cut_at_stop(incremental.text, spec.stop_strings, max(0, before - longest_stop + 1))
            finish = "stop" if stopped else delta.finish_reason
            end = len(text) if finish else max(before, len(text) - stop_prefix_length(text, spec.stop_strings))
            new = text[before:end]
            sent[delta.index] = end
            if finish:
                done.add(delta.index)
            del pending[delta.index]
            if new or finish or new_tokens:
                yield delta.index, new, new_tokens, new_lps, finish

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:24]}"

"""OpenAI-compatible and Anthropic Messages handlers: request models in, OpenAIService calls, response shapes out
(including server-sent-event streams).

`router` (OpenAI: models, completions, chat completions) is mounted twice by the app: at `/v1` and at Tinker's
`/oai/api/v1`, where `model` may also be a `tinker://.../sampler_weights/...` path; `anthropic_router` (Messages) at
`/v1` only."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway_svc.http_errors import classify
from gateway_svc.openai_service import OpenAIService
from loraplane import errors

router = APIRouter()
anthropic_router = APIRouter()


class _Loose(BaseModel):
    # Clients send many fields we do not use (user, presence_penalty, ...): ignored, not refused.
    model_config = ConfigDict(extra="ignore")


class CompletionRequest(_Loose):
    model: str
    prompt: Any
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    stream: bool = False
    echo: bool = False


class ChatRequest(_Loose):
    model: str
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    stream: bool = False


class MessagesRequest(_Loose):
    model: str
    messages: list[dict[str, Any]]
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False


def _svc(request: Request) -> OpenAIService:
    return request.app.state.openai


def _stream_error(exc: BaseException) -> str:
    """An error after a stream's headers went out: one server-sent event in OpenAI's error shape."""
    _status, _category, openai_type, _anthropic_type, message = classify(exc)
    return "data: " + json.dumps({"error": {"message": message, "type": openai_type}}) + "\n\n"


_END = object()


async def started(deltas: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`deltas` with its first item already awaited. A stream's headers (HTTP 200) go out with its first byte, so
    everything that can refuse the request (the model name, the caller's permission on its adapter, the sampler's
    own checks) must answer before that: awaited here, a refusal is the route's exception and gets its own status
    (401 / 403 / 404 / 400) and error body, which the official clients raise as PermissionDeniedError etc."""
    first = await anext(deltas, _END)

    async def rest():
        if first is _END:
            return
        yield first
        async for delta in deltas:
            yield delta
    return rest()


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"cache-control": "no-cache"})


def _usage(prompt: list[int], completion: int) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion}


async def _token_strings(svc: OpenAIService, tokens: list[int]) -> list[str]:
    tokenizer = await svc.tokenizer()
    return [tokenizer.decode([t]) for t in tokens]


@router.get("/models")
async def models(request: Request):
    return {"object": "list", "data": await _svc(request).models()}


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    svc = _svc(request)
    if body.echo:
        raise errors.InvalidArgument("echo: not supported", field="echo")
    prompt = await svc.encode_prompt(body.prompt)
    spec = svc.spec(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=None,
                    stop=body.stop, seed=body.seed)
    cid, created = svc.new_id("cmpl"), int(time.time())
    if body.stream:
        deltas = await started(svc.stream(body.model, prompt, body.n, spec))

        async def events():
            try:
                async for index, text, tokens, lps, finish in deltas:
                    choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
                    if body.logprobs is not None:
                        choice["logprobs"] = {"tokens": await _token_strings(svc, tokens), "token_logprobs": lps,
                                              "top_logprobs": None, "text_offset": []}
                    yield "data: " + json.dumps({"id": cid, "object": "text_completion", "created": created,
                                                 "model": body.model, "choices": [choice]}) + "\n\n"
            except Exception as exc:  # noqa: BLE001 - headers are sent: the error goes in-stream
                yield _stream_error(exc)
            yield "data: [DONE]\n\n"
        return _sse(events())
    choices = await svc.generate(body.model, prompt, body.n, spec)
    out = []
    for i, c in enumerate(choices):
        logprobs = None
        if body.logprobs is not None:
            logprobs = {"tokens": await _token_strings(svc, c.tokens), "token_logprobs": c.logprobs,
                        "top_logprobs": None, "text_offset": []}
        out.append({"index": i, "text": c.text, "finish_reason": c.finish_reason, "logprobs": logprobs})
    return {"id": cid, "object": "text_completion", "created": created, "model": body.model, "choices": out,
            "usage": _usage(prompt, sum(len(c.tokens) for c in choices))}


@router.post("/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    svc = _svc(request)
    if body.top_logprobs:
        raise errors.InvalidArgument("top_logprobs: not supported (per-token logprobs only)", field="top_logprobs")
    prompt = await svc.encode_chat(body.messages)
    spec = svc.spec(max_tokens=body.max_completion_tokens or body.max_tokens, temperature=body.temperature,
                    top_p=body.top_p, top_k=None, stop=body.stop, seed=body.seed)
    cid, created = svc.new_id("chatcmpl"), int(time.time())

    async def content_logprobs(tokens: list[int], lps: list[float]):
        strings = await _token_strings(svc, tokens)
        return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                            for s, lp in zip(strings, lps)]}

    if body.stream:
        deltas = await started(svc.stream(body.model, prompt, body.n, spec))

        async def events():
            def chunk(index, delta, finish, logprobs=None):
                return "data: " + json.dumps({
                    "id": cid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                    "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                                 "logprobs": logprobs}]}) + "\n\n"
            for i in range(body.n):
                yield chunk(i, {"role": "assistant", "content": ""}, None)
            try:
                async for index, text, tokens, lps, finish in deltas:
                    logprobs = await content_logprobs(tokens, lps) if body.logprobs else None
                    yield chunk(index, {"content": text} if text else {}, finish, logprobs)
            except Exception as exc:  # noqa: BLE001 - headers are sent: the error goes in-stream
                yield _stream_error(exc)
            yield "data: [DONE]\n\n"
        return _sse(events())
    choices = await svc.generate(body.model, prompt, body.n, spec)
    out = []
    for i, c in enumerate(choices):
        out.append({"index": i, "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason,
                    "logprobs": await content_logprobs(c.tokens, c.logprobs) if body.logprobs else None})
    return {"id": cid, "object": "chat.completion", "created": created, "model": body.model, "choices": out,
            "usage": _usage(prompt, sum(len(c.tokens) for c in choices))}


_STOP_REASON = {"stop": "end_turn", "length": "max_tokens"}


@anthropic_router.post("/messages")
async def messages(body: MessagesRequest, request: Request):
    svc = _svc(request)
    system = svc.text_of(body.system, "system") if body.system is not None else None
    prompt = await svc.encode_chat(body.messages, system)
    spec = svc.spec(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                    stop=body.stop_sequences, seed=None)
    mid = svc.new_id("msg")

    def stop_of(choice_finish: str, text_cut_by: str | None) -> tuple[str, str | None]:
        return ("stop_sequence", text_cut_by) if text_cut_by else (_STOP_REASON.get(choice_finish, "end_turn"), None)

    if body.stream:
        deltas = await started(svc.stream(body.model, prompt, 1, spec))

        async def events():
            def event(name: str, data: dict) -> str:
                return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"
            yield event("message_start", {"message": {
                "id": mid, "type": "message", "role": "assistant", "model": body.model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": len(prompt), "output_tokens": 0}}})
            yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            produced: list[int] = []
            finish = "stop"
            try:
                async for _i, text, tokens, _lps, fin in deltas:
                    produced.extend(tokens)
                    if text:
                        yield event("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                                  "text": text}})
                    if fin:
                        finish = fin
            except Exception as exc:  # noqa: BLE001 - headers are sent: the error goes in-stream
                yield event("error", {"error": {"type": classify(exc)[3], "message": classify(exc)[4]}})
                return
            yield event("content_block_stop", {"index": 0})
            raw = (await svc.tokenizer()).decode(produced, skip_special_tokens=True)
            reason, seq = stop_of(finish, next((s for s in spec.stop_strings if s and s in raw), None))
            yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                          "usage": {"output_tokens": len(produced)}})
            yield event("message_stop", {})
        return _sse(events())
    choice = (await svc.generate(body.model, prompt, 1, spec))[0]
    raw = (await svc.tokenizer()).decode(choice.tokens, skip_special_tokens=True)
    hit = next((s for s in spec.stop_strings if s and s in raw), None)
    reason, seq = stop_of(choice.finish_reason, hit)
    return {"id": mid, "type": "message", "role": "assistant", "model": body.model,
            "content": [{"type": "text", "text": choice.text}], "stop_reason": reason, "stop_sequence": seq,
            "usage": {"input_tokens": len(prompt), "output_tokens": len(choice.tokens)}}

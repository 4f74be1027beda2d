"""What every isolation case checks, for gRPC and HTTP alike:

- B's answer for A's existing resource and for a never-existing one of the same shape are indistinguishable: the
  same status and the same message once the two ids are replaced by the same placeholder;
- no byte of any answer to B carries something of A's (names, ids, tinker:// paths, request ids, key tokens,
  sha256s, metadata values) that B did not itself send, nor an internal address of the cluster;
- A's state is byte-for-byte the same after B's tries (Secured.snapshot);
- the very same call with A's key succeeds, so a case that passes does so because B is refused, not because the call
  is broken."""

from __future__ import annotations

import secrets as _random
from collections.abc import Iterable


def missing_like(ids: dict[str, str]) -> dict[str, str]:
    """Ids of the same shape as A's that were never issued to anyone (a fresh session id, its model, its paths)."""
    session = "s" + _random.token_hex(6)
    model = f"{session}:train:0"
    tag = _random.token_hex(3)
    out = dict(ids)
    out.update(
        session=session, model=model, sampler=f"{session}:sample:0", request=_random.token_hex(16),
        create_request=_random.token_hex(16), ckpt_w=f"tinker://{model}/weights/acme-ckpt-w",
        ckpt_s=f"tinker://{model}/sampler_weights/acme-ckpt-s",
        ckpt_del=f"tinker://{model}/sampler_weights/acme-ckpt-del", gw_adapter=f"acme/{session}-train-0",
        ckpt_x=f"tinker://{model}/external_weights/acme-ckpt-x",
        url_forged=_random.token_urlsafe(60).replace("-", "a").replace("_", "b") + "." + _random.token_hex(32),
        reg=f"acme/secret-reg-{tag}", train=f"acme/secret-train-{tag}", alias=f"alias{tag}")
    return out


def normalize(text: str, *id_maps: dict[str, str]) -> str:
    """`text` with every id of the maps replaced by `<its key>`: the two answers of a case (A's id, a missing id)
    must then be equal. Longest values first, so a model id is replaced before the session id inside it."""
    pairs = sorted(((v, k) for m in id_maps for k, v in m.items() if isinstance(v, str) and len(v) >= 3),
                   key=lambda p: -len(p[0]))
    for value, key in pairs:
        text = text.replace(value, f"<{key}>")
    return text


def leaked(answer: bytes, request: bytes, secrets: Iterable[str], addresses: Iterable[str]) -> list[str]:
    """What of A's (that B did not send) or of the cluster's internals `answer` carries."""
    found = [s for s in secrets if s and s.encode() not in request and s.encode() in answer]
    return found + [a for a in addresses if a.encode() in answer]

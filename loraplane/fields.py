"""The rules every service applies to adapter names, aliases and metadata: one definition, so the trainer refuses
before it queues exactly what the registry would refuse after, and the sampler checks names the same way."""

from __future__ import annotations

import re
from collections.abc import Mapping

from loraplane.errors import InvalidArgument, shown

_NAME_PART = r"[a-z0-9][a-z0-9._-]{0,62}"
# \Z, not $: "$" also matches before a trailing newline.
NAME_RE = re.compile(rf"^(?:{_NAME_PART}/)?{_NAME_PART}\Z")
ALIAS_RE = re.compile(rf"^{_NAME_PART}\Z")
MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY_CHARS = 128
MAX_METADATA_VALUE_CHARS = 4096


def validate_name(name: str, field: str = "name") -> str:
    if not NAME_RE.match(name or ""):
        raise InvalidArgument(
            f"{field}: {shown(name)} is not a valid adapter name: it must match ^[a-z0-9][a-z0-9._-]{{0,62}}$, "
            "optionally prefixed by a tenant of the same form and '/'", field=field, reason="INVALID_NAME")
    return name


def validate_alias(alias: str, field: str = "alias") -> str:
    if not ALIAS_RE.match(alias or ""):
        raise InvalidArgument(
            f"{field}: {shown(alias)} is not a valid alias: it must match ^[a-z0-9][a-z0-9._-]{{0,62}}$",
            field=field, reason="INVALID_ALIAS")
    return alias


def validate_metadata(metadata: Mapping[str, str], field: str = "metadata", *,
                      max_entries: int = MAX_METADATA_ENTRIES, max_key_chars: int = MAX_METADATA_KEY_CHARS,
                      max_value_chars: int = MAX_METADATA_VALUE_CHARS) -> dict[str, str]:
    if len(metadata) > max_entries:
        raise InvalidArgument(f"{field}: {len(metadata)} entries, at most {max_entries} are allowed", field=field)
    for key, value in metadata.items():
        if not key or len(key) > max_key_chars:
            raise InvalidArgument(f"{field}: key {shown(key)} must be 1 to {max_key_chars} characters", field=field)
        if len(value) > max_value_chars:
            raise InvalidArgument(f"{field}[{shown(key)}]: value of {len(value)} characters, at most "
                                  f"{max_value_chars} are allowed", field=field)
    return dict(metadata)

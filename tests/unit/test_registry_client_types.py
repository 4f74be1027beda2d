"""The registry client's wire -> domain conversion: what the sampler's adapter manager and the SDK read of a version
and an event is plain Python, and a value newer than this library survives it."""

from __future__ import annotations

from loraplane.registry_client import EventType, StoredVersion, VersionKind, stored_version
from loraplane.v1 import common_pb2, registry_pb2


def test_stored_version_carries_every_field():
    message = common_pb2.AdapterVersion(adapter="team/a", version=3, kind=common_pb2.VERSION_KIND_TRAINING_STATE,
                                        sha256="ab" * 32, size_bytes=10, training_step=4, metadata={"k": "v"},
                                        aliases=["prod", "canary"])
    message.create_time.FromNanoseconds(1_700_000_000_500_000_000)
    assert stored_version(message) == StoredVersion(
        adapter="team/a", version=3, kind=VersionKind.TRAINING_STATE, sha256="ab" * 32, size_bytes=10,
        training_step=4, metadata={"k": "v"}, aliases=("prod", "canary"), create_time=1_700_000_000.5)
    assert stored_version(common_pb2.AdapterVersion()).create_time is None


def test_values_newer_than_the_library_keep_their_number_and_match_no_member():
    newer_kind = stored_version(common_pb2.AdapterVersion(kind=7)).kind
    assert isinstance(newer_kind, VersionKind) and newer_kind == 7
    assert newer_kind not in (VersionKind.WEIGHTS, VersionKind.UNSPECIFIED)
    assert EventType(9) == 9 and EventType(9) not in list(EventType)


def test_the_members_are_the_wire_values():
    # The trainer passes VersionKind members to publish as they are, and compares download's kind with them.
    assert {k.name: int(k) for k in VersionKind} == {
        name.removeprefix("VERSION_KIND_"): number for name, number in common_pb2.VersionKind.items()}
    assert {t.name: int(t) for t in EventType} == {
        name.removeprefix("EVENT_TYPE_"): number for name, number in registry_pb2.EventType.items()}

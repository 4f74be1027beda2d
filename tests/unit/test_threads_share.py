"""The services of one host share its cores (issue 31 item 8): each compute service's thread count."""

from __future__ import annotations

import pytest

from loraplane.config import Settings
from loraplane.threads import THREADS_ENV, thread_shares
from loraplane_cli.local_cluster import cluster_thread_shares


@pytest.mark.parametrize(("cores", "services", "shares"), [
    (2, 2, [1, 1]),        # this machine: a trainer and a sampler, one core each
    (16, 2, [8, 8]),
    (16, 3, [6, 5, 5]),    # the remainder goes to the first services: every core is used
    (2, 3, [1, 1, 1]),     # more services than cores: one thread each, never zero
    (8, 1, [8]),           # a service alone keeps every core
])
def test_the_cores_split_as_evenly_as_they_go_and_every_service_gets_at_least_one(cores, services, shares):
    assert thread_shares(cores, services) == shares


@pytest.mark.parametrize(("cores", "services"), [(0, 1), (4, 0), (-1, 2)])
def test_no_cores_or_no_services_is_refused(cores, services):
    with pytest.raises(ValueError, match="at least 1"):
        thread_shares(cores, services)


def test_the_local_cluster_gives_each_compute_instance_its_share_unless_the_user_set_one():
    assert cluster_thread_shares(["trainer", "trainer-1", "sampler"], 4, {}) == {
        "trainer": "2", "trainer-1": "1", "sampler": "1"}
    # The user's LORAPLANE_TORCH_THREADS reaches every service unchanged through the environment instead.
    assert cluster_thread_shares(["trainer", "sampler"], 4, {THREADS_ENV: "3"}) == {}


def test_the_setting_reads_the_environment_and_defaults_to_torchs_own_count(monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert Settings().torch_threads == 0
    monkeypatch.setenv(THREADS_ENV, "3")
    assert Settings().torch_threads == 3

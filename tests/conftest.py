"""Shared fixtures: no test may leave a shared-memory segment behind.

Other test runs (other engineers, other sessions) may create and remove
``/dev/shm/gearflow*`` segments at the same time as this one, so the leak check
only counts new segments that belong to this test process: created by it
(owner pid or the default ``gearflow_<pid>_`` name) or named with the
:func:`shm_name` prefix that tests use for segments they name themselves.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

# One intra-op thread in the test process. Its models are tiny, and the suite runs beside actor,
# shard and learner subprocesses on 2 cores: OpenMP workers spinning for a core that another
# process holds made a 1500-step EnvPool actor test take 207 s instead of 20 s on a loaded box.
# Tests that measure or need several threads set them themselves (and restore them).
torch.set_num_threads(1)

from gearflow.kinds.transition import Transition
from gearflow.replay import Table, make_selector
from gearflow.replay.rate_limiter import RateLimiter
from gearflow.replay.spec import TableSpec
from gearflow.replay.storage import PREFIX, SHM_DIR, SharedStorage, list_segments


def pytest_collection_modifyitems(config, items):
    """With pytest-xdist (``-n 2 --dist loadgroup``: not the README's command yet — the third whole
    run so had two cluster tests fail under the other worker's load), the tests that start
    whole clusters — emulated hosts (``hosts``) and Ray — run one after another on one worker: two
    Ray heads, or two sets of namespaced hosts with their relays, never share the box at once."""
    for item in items:
        if item.get_closest_marker("hosts") or item.path.name.startswith("test_ray"):
            item.add_marker(pytest.mark.xdist_group("clusters"))


def seg_prefix() -> str:
    """Prefix of segment names that tests choose themselves (counted by the leak check)."""
    return f"{PREFIX}_test_{os.getpid()}_"


def shm_name(tag: str = "") -> str:
    return f"{seg_prefix()}{tag}{uuid.uuid4().hex[:8]}"


def _ours(name: str, owner: int | None) -> bool:
    pid = os.getpid()
    return owner == pid or name.startswith((f"{PREFIX}_{pid}_", seg_prefix()))


def _snapshot() -> dict[str, int | None]:
    """name → owner pid (None for a file that is not (yet) a gearflow table)."""
    owners: dict[str, int | None] = {p.name: None for p in SHM_DIR.glob(f"{PREFIX}*")}
    owners.update({name: owner for name, owner, _ in list_segments()})
    return owners


@pytest.fixture(autouse=True)
def no_leaked_segments():
    before = set(_snapshot())
    yield
    after = _snapshot()
    leaked = sorted(n for n, owner in after.items() if n not in before and _ours(n, owner))
    for name in leaked:  # clean up first, so one failure does not cascade into the next test
        Path(SHM_DIR / name).unlink(missing_ok=True)
    if leaked:
        pytest.fail(f"test left shared-memory segment(s) behind: {leaked}", pytrace=False)


SMALL_SPEC = {"obs": "float32[3]", "frame": "uint8[2,4]", "action": "int64", "done": "bool"}


@pytest.fixture
def make_table():
    """``make_table(spec=..., P=2, S=32, R=None, kind=Transition(), selector="uniform",
    limiter=None, **table_kwargs) -> Table``; every table (and its segment) is closed
    and unlinked at teardown, whatever the test did."""
    tables: list[Table] = []

    def make(
        spec=None,
        P: int = 2,
        S: int = 32,
        R: int | None = None,
        kind=None,
        selector: str = "uniform",
        limiter: RateLimiter | None = None,
        selector_kwargs: dict | None = None,
        table_cls=Table,
        **table_kwargs,
    ) -> Table:
        spec = spec if isinstance(spec, TableSpec) else TableSpec.parse(spec or SMALL_SPEC)
        table_kwargs.setdefault("sample_timeout_s", 5.0)  # a test that blocks fails fast
        storage = SharedStorage.create(
            spec, num_partitions=P, steps_per_partition=S, items_per_partition=R
        )
        try:
            sel = make_selector(
                selector, P * storage.items_per_partition, seed=0, **(selector_kwargs or {})
            )
            table = table_cls(storage, kind or Transition(), sel, limiter, **table_kwargs)
        except BaseException:
            storage.close()
            storage.unlink()
            raise
        tables.append(table)
        return table

    yield make
    for t in tables:
        name = t.storage.name
        with contextlib.suppress(Exception):  # a test may have closed it already
            t.close()
        (SHM_DIR / name).unlink(missing_ok=True)


@pytest.fixture
def storage_factory():
    """``storage_factory(spec, P, S, R=None, name=None) -> SharedStorage``, unlinked at teardown."""
    made: list[SharedStorage] = []

    def make(spec=None, P: int = 2, S: int = 16, R: int | None = None, name: str | None = None):
        spec = spec if isinstance(spec, TableSpec) else TableSpec.parse(spec or SMALL_SPEC)
        st = SharedStorage.create(
            spec, num_partitions=P, steps_per_partition=S, items_per_partition=R, name=name
        )
        made.append(st)
        return st

    yield make
    for st in made:
        if st.header is not None:
            st.close()
        st.unlink()


SHARD_TOKEN = "test-token-0123456789"  # the shards shard_of starts, unless a test names another


@pytest.fixture
def shard_of():
    """``shard_of(table, token=SHARD_TOKEN, **kw) -> (ShardService, port)``: a started shard
    service over ``table`` on loopback, stopped at teardown."""
    from gearflow.transport.server.shard import ShardService

    made = []

    def make(table, token: str = SHARD_TOKEN, **kw):
        s = ShardService(table, token=token, **kw)
        made.append(s)
        return s, s.start()

    yield make
    for s in made:
        s.stop()


_host_sets = itertools.count()  # a bridge/namespace prefix per set: several test runs coexist


@pytest.fixture
def make_hosts():
    """``make_hosts(n, subnet=..., rate_mbit=None) -> Hosts`` (up): emulated hosts from
    launch/hosts.py, for tests marked with ``tests.helpers_hosts.hosts_tests``. Every set is
    brought down at teardown and the test fails if a namespace, veth or bridge of it is left."""
    from launch.hosts import Hosts

    made: list[Hosts] = []

    def make(n: int, subnet: str, **kwargs) -> Hosts:
        hosts = Hosts(n, subnet=subnet, name=f"t{os.getpid() % 100000}{next(_host_sets)}", **kwargs)
        made.append(hosts)
        return hosts.up()

    yield make
    for hosts in made:
        hosts.down()
    names = [h.name for hosts in made for h in hosts]
    bridges = [hosts.bridge for hosts in made]
    left = subprocess.run(["ip", "-o", "link"], check=False, capture_output=True, text=True).stdout
    netns = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout.split()
    leaked = [n for n in names if n in netns] + [b for b in bridges if f" {b}:" in left]
    assert not leaked, f"emulated hosts left behind: {leaked}"

"""Emulated hosts for tests (launch/hosts.py): the ``hosts`` marker, a factory fixture, and the
commands of a sharded run (``gearflow serve`` nodes, a learner over ``transport.shards``) on them.

Use it in a test module::

    from tests.helpers_hosts import hosts_tests, serve_on
    pytestmark = hosts_tests

    def test_x(make_hosts, tmp_path):                   # the fixture is in tests/conftest.py
        hosts = make_hosts(3, subnet="10.231.7.0/24")   # down (and checked gone) at teardown
        node = serve_on(hosts[0], tmp_path / "n0", port=7000)
        address = node.address()                         # waits for the node to listen

Each test gets a bridge/namespace prefix of its own (from the pid and a counter), so several test
processes coexist; subnets only need to differ for readability (the bridges carry no address, so
two sets of hosts never see each other whatever their subnets).
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from launch.hosts import available
from tests.test_train import CONFIG, ROOT, TINY

TOKEN = "hosts-test-secret-0123"
REASON = available()
hosts_tests = [pytest.mark.hosts, pytest.mark.skipif(REASON is not None, reason=f"{REASON}")]


def env() -> dict:
    """The environment of every command on the hosts: the run's secret, this checkout first."""
    # an interface name of this host means nothing on another: each host's learner finds its own
    here = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    return {**here, "GEARFLOW_TOKEN": TOKEN, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


class Proc:
    """A command on a host whose stderr is read line by line (``wait_for`` a line, never a clock)."""

    def __init__(self, popen: subprocess.Popen, log: Path):
        self.popen, self.log = popen, log
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log, "w") as out:
            for line in self.popen.stderr:
                out.write(line)
                out.flush()
                self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout: float = 180.0) -> re.Match:
        """The first stderr line (from now on) matching ``pattern``; fails with the log's tail
        when the command ends first (``timeout`` only bounds a hung test)."""
        rx = re.compile(pattern)
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in {timeout} s:\n{self.tail()}") from None
            if line is None:
                self.popen.wait()
                raise AssertionError(f"exited {self.popen.returncode} before a line matching {pattern!r}:\n{self.tail()}")
            self.seen.append(line)
            if m := rx.search(line):
                return m

    def wait_for_updates(self, more: int) -> int:
        """Read progress lines until the learner's updates grew by more than ``more`` past the
        first one read; returns the last count."""
        first = None
        while True:
            updates = int(self.wait_for(r"progress: steps \d+ .* updates (\d+) ").group(1))
            first = updates if first is None else first
            if updates > first + more:
                return updates

    def address(self) -> str:
        """A ``gearflow serve`` node's ``host:port``, once it listens (its first stdout line)."""
        line = self.popen.stdout.readline()
        if not line:
            self.popen.wait()
            raise AssertionError(f"gearflow serve exited {self.popen.returncode}:\n{self.tail()}")
        return json.loads(line)["serving"]

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text()[-n:] if self.log.exists() else ""

    def finish(self, timeout: float = 120.0) -> tuple[int, str]:
        """Wait for the end: (returncode, stdout)."""
        out = self.popen.stdout.read() if self.popen.stdout else ""
        self.popen.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return self.popen.returncode, out

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()


def gearflow_on(host, command: str, log: Path, *args: str) -> Proc:
    """``gearflow COMMAND CONFIG TINY ARGS`` on ``host`` (stdout and stderr piped; stderr logged)."""
    argv = [sys.executable, "-m", "gearflow", command, CONFIG, *TINY, *args]
    popen = host.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env())
    return Proc(popen, log)


def serve_on(host, run_dir: Path, port: int, *args: str) -> Proc:
    """A ``gearflow serve`` node on ``host``, listening on ``host.address:port``."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return gearflow_on(host, "serve", run_dir.with_suffix(".err"), "actor.num_actors=1", f"run.dir={run_dir}",
                       f"transport.host={host.address}", f"transport.port={port}", *args)  # fmt: skip

"""A client's wire thread (``gearflow/transport/wire_io.py``): big reply blocks read and MACed in
a thread of the connection's own, and what it does when the peer stops half-way."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from gearflow.transport import wire_io
from gearflow.transport.client import Client, ServiceUnavailable
from gearflow.transport.service import ANY_ROLE, Service
from tests.helpers_relay import LoopbackRelay

TOKEN = "wire-io-test-token"
ROOT = Path(__file__).resolve().parent.parent
BIG = np.arange(1 << 19, dtype=np.float32)  # 2 MiB: over wire_io.WIRE_BYTES

pytestmark = pytest.mark.skipif(not wire_io.available(), reason="_mac.c is not built here")


def _service(integrity: bool = True) -> Service:
    svc = Service(token=TOKEN, name="wire", integrity=integrity)
    svc.register("big.get", lambda meta, bufs: ({"i": meta.get("i")}, [BIG]), roles=ANY_ROLE)
    svc.register("small.get", lambda meta, bufs: ({"i": meta.get("i")}, [np.arange(8)]), roles=ANY_ROLE, inline=True)
    svc.start()
    return svc


@pytest.fixture
def service():
    svc = _service()
    yield svc
    svc.stop()


class _Cut(LoopbackRelay):
    """Passes everything until :attr:`armed` is set, then the service's next ``budget`` bytes, and
    stops there: ``close=True`` ends the connection (a host that crashed), else it stays open and
    silent (a host whose link went down)."""

    def __init__(self, upstream: int, budget: int, close: bool):
        self.budget, self.close_at_cut = budget, close
        self.armed, self.cut = threading.Event(), threading.Event()
        super().__init__(upstream)

    def pump(self, src, dst, direction, state) -> None:
        left = None
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                return
            if not data:
                return self.shut(dst)
            if direction == "s2c" and self.armed.is_set():
                left = self.budget if left is None else left
                data, left = data[:left], left - min(left, len(data))
            try:
                dst.sendall(data)
            except OSError:
                return
            if left == 0:
                self.cut.set()
                if self.close_at_cut:
                    self.shut(src, dst)
                return


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _wire_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("gearflow-wire")]


@pytest.mark.parametrize("integrity", [True, False], ids=["integrity", "plain"])
def test_big_replies_are_read_by_the_wire_thread_in_order_with_small_ones(integrity):
    """Big and small replies pipelined on one connection arrive whole and in order, the big ones'
    blocks read by the client's wire thread (MACed as they land, with integrity) and the small
    ones through the loop; the loop reads again after each big one."""
    svc = _service(integrity)
    try:
        with Client(("127.0.0.1", svc.port), TOKEN, timeout_s=20, integrity=integrity) as c:
            ops = ["big.get", "small.get", "big.get", "big.get", "small.get", "small.get", "big.get"]
            futs = [c.submit(op, {"i": i}) for i, op in enumerate(ops)]
            for i, (op, f) in enumerate(zip(ops, futs)):
                meta, (arr,) = c.result(f, op, 20)
                assert meta == {"i": i} and np.array_equal(arr, BIG if op == "big.get" else np.arange(8)), op
            assert c._proto._wire.received == 4
    finally:
        svc.stop()


@pytest.mark.parametrize("close,end", [(True, None), (False, "drop"), (False, "close")],
                         ids=["peer-closes", "peer-silent-dropped", "peer-silent-closed"])
def test_a_reply_cut_half_way_fails_the_call_and_frees_the_wire_thread(service, close, end):
    """The service's bytes stop 1 MiB into a 2 MiB reply block. Closed there: the call fails with
    ServiceUnavailable at once (the wire thread's read sees the end, not the call's timeout).
    Left silent: dropping the connection (what a learner does with a host marked down) or closing
    the client wakes the wire thread blocked on it (closing shuts no other duplicate of the socket
    down: the wire thread's own shutdown must). Either way no wire thread is left and its socket
    is closed."""
    fds = _fds()
    relay = _Cut(service.port, budget=1 << 20, close=close)
    c = Client(("127.0.0.1", relay.port), TOKEN, timeout_s=60)
    try:
        c.call("small.get", {"i": 0})  # the handshake and a small reply pass whole
        relay.armed.set()  # the service's next 1 MiB pass (the big reply's header and half its block), then the cut
        fut = c.submit("big.get", {"i": 1})
        assert relay.cut.wait(30)
        if not close:  # a silent peer: the wire thread waits on it until the connection is dropped
            assert not fut.done()
            c.drop() if end == "drop" else c.close()
        with pytest.raises(ServiceUnavailable):
            c.result(fut, "big.get", 30)
        for t in _wire_threads():
            t.join(30)
        assert not _wire_threads()
    finally:
        c.close()
        relay.close()
    assert _fds() <= fds + 2  # (the relay's listener may linger a moment; the client's duplicate does not)


def test_a_wire_thread_waiting_on_a_silent_peer_does_not_hold_up_the_exit(service):
    """A process whose client is left open while its wire thread waits on a silent peer mid-block
    exits when its main thread ends (the wire thread is a daemon: an executor's thread, joined at
    exit, would hang it as long as the peer stays silent)."""
    relay = _Cut(service.port, budget=1 << 20, close=False)
    code = (
        "import sys\n"
        "from gearflow.transport.client import Client\n"
        f"c = Client(('127.0.0.1', {relay.port}), {TOKEN!r}, timeout_s=600)\n"
        "c.call('small.get', {'i': 0})\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"  # the relay armed: the big reply stops half-way
        "fut = c.submit('big.get', {'i': 1})\n"
        "sys.stdin.readline()\n"  # the cut reached: the wire thread waits on the silent peer
        "import threading, time\n"
        "while not any(t.name == 'gearflow-wire' for t in threading.enumerate()):\n"
        "    time.sleep(0.01)\n"  # the client has read the reply's header and handed the block over
        "print('leaving', fut.done(), flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"
        relay.armed.set()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert relay.cut.wait(60)
        proc.stdin.write("leave\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "leaving False"
        assert proc.wait(timeout=120) == 0  # a hang here is the bug (the peer stays silent for good)
    finally:
        if proc.poll() is None:
            proc.kill()
        relay.close()

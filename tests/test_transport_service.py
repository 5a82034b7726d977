"""Framing, the service and the client on their own (real sockets on loopback).

* Frames round-trip through ``FrameReader`` whatever the chunking of the byte stream
  (hypothesis), buffers aligned, dtypes and shapes kept; every limit is refused with a
  FrameError naming it, before allocation (the allocator is never called).
* The service under both loops (uvloop, asyncio): echo of many buffers and a 40 MB frame,
  errors mapped to their types (or RemoteError), an unknown message type, a slow handler
  past the call's timeout (RequestTimeout, the connection still usable), requests of one
  connection handled in order, `with_connection` state and on_close, handlers registered
  twice refused, `Defer` from an inline handler.
"""

from __future__ import annotations

import select
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gearflow.transport.client import (
    Client,
    RemoteError,
    RequestTimeout,
    ServiceUnavailable,
    parse_address,
)
from gearflow.transport.framing import (
    ALIGN,
    REPLY,
    REQUEST,
    FrameError,
    FrameLimits,
    FrameReader,
    encode,
    new_event_loop,
)
from gearflow.transport.service import Defer, Service

TOKEN = "service-test-token-1"


def parse(stream: bytes, chunks: list[int], limits: FrameLimits | None = None, alloc=None) -> list:
    limits = limits or FrameLimits()
    out = []
    r = FrameReader(lambda *f: out.append(f), limits, {REQUEST, REPLY}, alloc=alloc, staging=4096)
    pos, i = 0, 0
    while pos < len(stream):
        buf = r.get_buffer(-1)
        n = min(len(buf), len(stream) - pos, max(1, chunks[i % len(chunks)]))
        buf[:n] = stream[pos:pos + n]
        r.buffer_updated(n)
        pos += n
        i += 1
    return out


arrays = st.lists(
    st.tuples(st.sampled_from(["uint8", "int64", "float32", "float64", "bool", "int16"]),
              st.lists(st.integers(0, 40), min_size=0, max_size=3)),
    max_size=6,
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(descr=arrays, chunks=st.lists(st.integers(1, 9000), min_size=1, max_size=8), n_frames=st.integers(1, 3))
def test_frames_round_trip_whatever_the_chunking(descr, chunks, n_frames):
    rng = np.random.default_rng(0)
    bufs = [rng.integers(0, 100, size=shape).astype(dt) for dt, shape in descr]
    stream = b"".join(bytes(p) for k in range(n_frames) for p in encode(REQUEST, 7 + k, "x.y", {"k": k, "s": "é"}, bufs))
    frames = parse(stream, chunks)
    assert len(frames) == n_frames
    for k, (kind, rid, op, meta, got, block) in enumerate(frames):
        assert (kind, rid, op, meta) == (REQUEST, 7 + k, "x.y", {"k": k, "s": "é"})
        assert len(got) == len(bufs)
        for a, b in zip(got, bufs):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
            if a.size:
                assert (a.__array_interface__["data"][0] - block.__array_interface__["data"][0]) % ALIGN == 0


def test_limits_are_refused_before_allocation():
    calls = []

    def alloc(n):
        calls.append(n)
        return np.empty(n, np.uint8)

    lim = FrameLimits(max_frame_bytes=1 << 16, max_meta_bytes=256, max_buffers=2, max_dims=2)
    cases = {
        "exceeds max_frame_bytes": encode(REQUEST, 1, "x", {}, [np.zeros(1 << 16, np.uint8)]),
        "exceed max_buffers": encode(REQUEST, 1, "x", {}, [np.zeros(1)] * 3),
        "exceeds max_meta_bytes": encode(REQUEST, 1, "x", {"a": "b" * 300}),
        "exceed max_dims": encode(REQUEST, 1, "x", {}, [np.zeros((1, 1, 1))]),
    }
    for why, parts in cases.items():
        with pytest.raises(FrameError, match=why):
            parse(b"".join(bytes(p) for p in parts), [1 << 20], lim, alloc)
    assert calls == []  # nothing was allocated for any of them
    with pytest.raises(FrameError, match="exceeds max_frame_bytes"):  # the sender refuses what the receiver would
        encode(REQUEST, 1, "x", {}, [np.zeros(1 << 16, np.uint8)], lim)
    with pytest.raises(FrameError, match="exceed max_buffers"):
        encode(REQUEST, 1, "x", {}, [np.zeros(1)] * 3, lim)
    with pytest.raises(FrameError, match="exceeds max_dims"):
        encode(REQUEST, 1, "x", {}, [np.zeros((1, 1, 1))], lim)
    with pytest.raises(FrameError, match="not allowed"):
        encode(REQUEST, 1, "x", {}, [np.zeros(2, np.complex64)])
    with pytest.raises(ValueError, match="transport.loop"):
        new_event_loop("tokio")
    assert parse_address("10.0.0.1:7000") == ("10.0.0.1", 7000)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address("nohost")


class Custom(Exception):
    pass


@pytest.fixture(params=["uvloop", "asyncio"])
def service(request):
    svc = Service(token=TOKEN, loop=request.param)
    order: list[int] = []
    closed = threading.Event()

    def remember(meta, bufs, conn):
        conn.state["n"] = conn.state.get("n", 0) + 1
        conn.on_close(closed.set)
        return {"n": conn.state["n"], "peer": conn.peer}, []

    def slow(meta, bufs):
        time.sleep(meta["s"])
        order.append(meta["i"])
        return {"i": meta["i"]}, []

    tried = []

    def maybe(meta, bufs, deferred=False):
        tried.append(deferred)
        if meta["block"] and not deferred:
            raise Defer
        return {"deferred": deferred}, []

    svc.register("echo", lambda m, b: (m, [x.copy() for x in b]))
    svc.register("fail", lambda m, b: (_ for _ in ()).throw(ValueError("bad value 7")))
    svc.register("custom", lambda m, b: (_ for _ in ()).throw(Custom("mine")))
    svc.register("remember", remember, with_connection=True)
    svc.register("slow", slow)
    svc.register("maybe", maybe, inline=True)
    svc.start()
    svc.order, svc.closed, svc.tried = order, closed, tried
    yield svc
    svc.stop()


def test_service_round_trips_and_errors(service):
    with pytest.raises(ValueError, match="already has a handler"):
        service.register("echo", lambda m, b: None)
    c = Client(("127.0.0.1", service.port), token=TOKEN, timeout_s=10, loop=service.loop_kind)
    bufs = [np.arange(5, dtype=np.int64), np.ones((3, 4), np.float32), np.zeros((0, 2), np.uint8), np.array([True])]
    meta, got = c.call("echo", {"a": [1, 2.5, None, "x"]}, bufs)
    assert meta == {"a": [1, 2.5, None, "x"]}
    for a, b in zip(got, bufs):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype and a.shape == b.shape
    big = np.random.default_rng(0).integers(0, 255, 40 << 20, dtype=np.uint8)
    assert np.array_equal(c.call("echo", {}, [big])[1][0], big)
    with pytest.raises(ValueError, match="bad value 7"):
        c.call("fail")
    with pytest.raises(RemoteError, match="Custom: mine") as info:
        c.call("custom")
    assert info.value.remote_type == "Custom"
    with pytest.raises(KeyError, match="no handler for message type 'nope'"):
        c.call("nope")
    # a slow handler past the call's timeout: RequestTimeout; the connection stays usable
    with pytest.raises(RequestTimeout, match="slow: no reply"):
        c.call("slow", {"s": 1.0, "i": 0}, timeout_s=0.2)
    assert c.call("ping")[0]["pong"]
    # one connection's requests are handled in order, even when pipelined
    futs = [c.submit("slow", {"s": 0.05 * (3 - i), "i": i}) for i in range(1, 4)]
    assert [c.result(f, "slow", 10)[0]["i"] for f in futs] == [1, 2, 3]
    assert service.order == [0, 1, 2, 3]
    # per-connection state, and on_close when the client goes
    assert c.call("remember")[0]["n"] == 1
    assert c.call("remember")[0]["n"] == 2
    assert c.call("maybe", {"block": False})[0] == {"deferred": False}
    assert c.call("maybe", {"block": True})[0] == {"deferred": True}
    assert service.tried == [False, False, True]
    c.close()
    assert service.closed.wait(5)
    c2 = Client(("127.0.0.1", service.port), token=TOKEN, timeout_s=10)
    assert c2.call("remember")[0]["n"] == 1  # a new connection, new state
    c2.close()
    stats = service.stats()
    assert stats["transport/errors"] == 3 and stats["transport/connections"] >= 2


def test_no_service_is_a_named_error_within_the_timeout():
    svc = Service(token=TOKEN)
    port = svc.start()
    svc.stop()  # the port is free again: nothing listens
    c = Client(("127.0.0.1", port), token=TOKEN, timeout_s=1.0, connect_timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(ServiceUnavailable, match="no service at"):
        c.call("ping")
    assert time.monotonic() - t0 < 3.0
    c.close()
    with pytest.raises(ValueError, match="GEARFLOW_TOKEN"):
        Service(token="")


def test_a_send_that_finds_the_connection_reset_reads_as_lost_at_once():
    """The kernel can report a connection the service reset to the thread sending on it before
    the client's loop has seen it close. That send's error must already make the connection
    read as lost (``connected`` false: the next call reconnects or fails with the outage), not
    as live: a writer that checked ``connected`` after its first error went on staging calls
    with no error at all (a CI failure of test_transport_faults)."""
    svc = Service(token=TOKEN)
    port = svc.start()
    c = Client(("127.0.0.1", port), token=TOKEN, timeout_s=2, connect_timeout_s=0.5)
    held, release = threading.Event(), threading.Event()

    def hold_the_loop():  # the client's loop sees nothing of the reset until released
        held.set()
        release.wait()

    try:
        assert c.call("ping")[0]["pong"]
        c._loop.call_soon_threadsafe(hold_the_loop)
        assert held.wait(10)
        svc.stop()  # the service's end closed
        c.submit("ping", timeout_s=0.5)  # sent to a closed socket: the service's kernel resets it
        reset = select.poll()
        reset.register(c._proto.wsock, select.POLLERR)
        assert reset.poll(10_000), "no reset reached the client's socket"
        assert c.connected  # the loop, held, has seen nothing of it
        with pytest.raises(ServiceUnavailable, match="lost sending ping"):
            c.submit("ping", timeout_s=0.5)
        assert not c.connected
        with pytest.raises(ServiceUnavailable, match="no service at"):
            c.call("ping", timeout_s=0.5)
    finally:
        release.set()
        c.close()
        svc.stop()


def test_the_client_logs_only_a_loss_it_did_not_ask_for(caplog):
    """Closing a client is not "connection lost"; a service that goes away is, once."""
    svc = Service(token=TOKEN)
    port = svc.start()
    lost = lambda: [r for r in caplog.records if "connection to" in r.getMessage() and "lost" in r.getMessage()]
    try:
        with caplog.at_level("INFO", logger="gearflow.transport.client"):
            c = Client(("127.0.0.1", port), token=TOKEN, timeout_s=5)
            assert c.call("ping")[0]["pong"]
            c.close()  # its own close: nothing to report
            c2 = Client(("127.0.0.1", port), token=TOKEN, timeout_s=5)
            assert c2.call("ping")[0]["pong"]
            svc.stop()  # the service goes: a loss, reported
            deadline = time.monotonic() + 10
            while not lost() and time.monotonic() < deadline:
                time.sleep(0.01)
            c2.close()
        assert [r.levelname for r in lost()] == ["INFO"]
        assert f"127.0.0.1:{port}" in lost()[0].getMessage()
    finally:
        svc.stop()

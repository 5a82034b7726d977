"""Transport measurements, each with its floor measured in the same run (for ``gearflow bench transport``).

    from gearflow.transport import bench
    for row in bench.run_all(seconds=2.0):
        print(json.dumps(row))

The shard runs in its own process (as on another machine: its own GIL).

Every ratio is the median of per-round ratios of alternating slices (a path and its floor
take turns), so load that comes and goes on a shared machine hits both alike.

* ``insert``: an Ape-X actor's writes (a TransitionAdder over 16 env streams, pre-made recvs,
  no env) through a RemoteWriter into a shard on loopback, against the same adder writing
  the shared-memory table directly (with its C n-step path, and with the numpy reference
  path a RemoteWriter gets), and through a ShippingWriter (a local ring, the C adder, shipped
  to the shard): env steps/s and the ratios.
* ``actor``: the Ape-X actor itself (EnvPool CartPole) locally, through a RemoteWriter and
  through a ShippingWriter: env steps/s and the ratios.
* ``sample``: RemoteSampler batches of Atari-sized rows (28 KiB) from a shard, requested
  ``LEARNER_PREFETCH`` rounds ahead as a learner over shard nodes does, against a raw TCP
  socket moving the same bytes per request (request → that many bytes back): batches/s,
  GB/s and the ratio. Three shards in the same rounds: with ``transport.integrity`` on (the
  default: every frame MACed, rows straight out of the segment, MACed there), off (rows
  straight out of the segment), and off with the rows gathered (the path before replies
  went out of the segment); with ``openssl`` at hand a fourth over mutual TLS (integrity on);
  ``integrity_cost`` is 1 − on/off, the median over rounds.
* ``latency``: request latency of a sample (small rows) at batch 32 and 256: p50/p99 in µs,
  with the raw socket's round trip of the same bytes as floor.
* ``writeback``: a learner's loop over two prioritized shards, each behind a relay adding a
  round trip (:class:`~gearflow.transport.relay.Relay`): updates/s with the priority write-back
  not waiting for its replies (the sampler's default) against the same loop waiting for every
  reply (``wait=True``, what the sampler did before), in alternating rounds.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np

from gearflow.kinds.transition import Transition
from gearflow.replay import RateLimiter, SharedStorage, Table, TableSpec, Writer, make_selector
from gearflow.transport.actor import RemoteWriter, ShippingWriter
from gearflow.transport.client import Client
from gearflow.transport.learner.sampler import LEARNER_PREFETCH, RemoteSampler
from gearflow.transport.server.shard import ShardService

TOKEN = "gearflow-bench-token"


def _table(spec: dict, P: int, S: int, selector: str = "uniform") -> Table:
    st = SharedStorage.create(TableSpec.parse(spec), P, S)
    return Table(st, Transition(next_columns=("obs",)), make_selector(selector, P * S, seed=0), RateLimiter(1))


def _recvs(E: int, b: int, n: int, obs_shape, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out, reset = [], np.ones(E, dtype=bool)
    for t in range(n):
        ids = np.sort(rng.choice(E, size=b, replace=False)).astype(np.int64)
        obs = rng.standard_normal((b, *obs_shape)).astype(np.float32)
        end = rng.random(b) < 0.01
        fresh = reset[ids]
        reward = np.where(fresh, 0.0, rng.standard_normal(b)).astype(np.float32)
        term = end & ~fresh
        reset[ids] = term
        out.append((ids, obs, reward, term, np.zeros(b, bool), fresh, rng.integers(0, 2, b), rng.standard_normal((b, 2)).astype(np.float32), t))
    return out


def _serve_shard(spec: dict, P: int, S: int, selector: str, wire: int | None, conn, integrity: bool = True,
                 tls: str = "", profile: bool = False, keep_digests: bool = True, tls_records: str = "gearflow") -> None:  # fmt: skip
    """Child process: a table and its shard service; sends the port, serves until told to stop
    (``"stop"``); with ``profile``, its phases are counted (``"profile"``: sends them and starts
    counting afresh); ``keep_digests=False``: its replies' row digests are computed at every
    draw (the cost when every drawn row is drawn for the first time)."""
    from gearflow.transport.auth import (
        set_default_integrity,
        set_default_tls,
        set_default_tls_records,
    )

    set_default_integrity(integrity)
    set_default_tls(tls)
    set_default_tls_records(tls_records)
    prof = None
    if profile:
        from gearflow.transport.profile import PhaseProfile

        prof = PhaseProfile().install()
    table = _table(spec, P, S, selector)
    shard = ShardService(table, token=TOKEN, wire_min_row_bytes=wire)
    shard.wire.keep_digests = keep_digests
    conn.send(shard.start())
    try:
        while conn.recv() == "profile":
            conn.send(prof.read() if prof is not None else {})
            if prof is not None:
                prof.reset()
    finally:
        shard.stop()
        table.close()


class ShardProcess:
    """A shard service in its own process (as on another machine: its own GIL)."""

    def __init__(self, spec: dict, P: int, S: int, selector: str = "uniform", wire: int | None = 1024,
                 integrity: bool = True, tls: str = "", profile: bool = False, keep_digests: bool = True,
                 tls_records: str = "gearflow"):  # fmt: skip
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.integrity = integrity
        self.proc = ctx.Process(target=_serve_shard, daemon=True,
                                args=(spec, P, S, selector, wire, child, integrity, tls, profile, keep_digests,
                                      tls_records))  # fmt: skip
        self.proc.start()
        if not self.conn.poll(120):
            raise RuntimeError("the shard process did not start")
        self.port = self.conn.recv()

    def profile(self) -> dict:
        """The shard's phase counters since the last call (a shard started with ``profile``)."""
        self.conn.send("profile")
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(30)


def insert(seconds: float = 2.0, E: int = 16, b: int = 8, obs=(4,), rounds: int = 5) -> dict:
    """The four writers alive side by side, measured in ``rounds`` alternating slices (the order
    rotates each round): each ratio is the median of the per-round ratios, so load that comes
    and goes on a shared machine hits a path and its floor alike."""
    from gearflow.kinds.transition import TransitionAdder

    spec = {"obs": f"float32[{','.join(map(str, obs))}]", "action": "int64", "ret": "float32", "disc": "float32",
            "version": "int64"}  # fmt: skip
    recvs = _recvs(E, b, 2000, obs)
    names = ("local", "local_numpy", "remote", "shipping")
    tables, shards, writers, adders = [], [], {}, {}
    try:
        for where in names:
            if where.startswith("local"):
                tables.append(_table(spec, E, 4096))
                writers[where] = Writer(tables[-1].storage, np.arange(E))
            else:
                shards.append(ShardProcess(spec, E, 4096))
                cls = RemoteWriter if where == "remote" else ShippingWriter
                writers[where] = cls(("127.0.0.1", shards[-1].port), num_streams=E, token=TOKEN)
            adders[where] = TransitionAdder(writers[where], 3, 0.99,
                                            **({"native": False} if where == "local_numpy" else {}))  # fmt: skip
        per: dict[str, list[float]] = {n: [] for n in names}
        at = 0
        for r in range(rounds):
            for where in names[r % 4:] + names[:r % 4]:
                adder, w = adders[where], writers[where]
                steps, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < seconds / rounds:
                    for k in range(200):
                        adder.add(*recvs[(at + k) % len(recvs)])
                    at += 200
                    steps += 200 * b
                w.flush()  # shipped and acknowledged inside the slice
                per[where].append(steps / (time.perf_counter() - t0))
        for where in names:
            adders[where].finish()
            writers[where].flush()
    finally:
        for where in ("remote", "shipping"):
            if where in writers:
                writers[where].close()
        for shard in shards:
            shard.close()
        for table in tables:
            table.close()

    def ratio(a: str, f: str) -> float:
        return float(np.median(np.array(per[a]) / np.array(per[f])))

    rates = {n: float(np.median(v)) for n, v in per.items()}
    return {"bench": "transport/insert", "envs": E, "recv_batch": b, "obs": list(obs), "rounds": rounds,
            "local_steps_per_s": rates["local"], "local_numpy_adder_steps_per_s": rates["local_numpy"],
            "remote_steps_per_s": rates["remote"], "ratio": ratio("remote", "local"),
            "ratio_same_adder": ratio("remote", "local_numpy"),
            "shipping_steps_per_s": rates["shipping"], "shipping_ratio": ratio("shipping", "local"),
            "shipping_ratio_rounds": [float(x) for x in np.array(per["shipping"]) / np.array(per["local"])]}  # fmt: skip


class _RawServer:
    """Floor: a TCP server that answers each 8-byte request (a byte count) with that many bytes."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.payload = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conn, _ = self.sock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view = memoryview(self.payload)
        try:
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    return
                conn.sendall(view[: int.from_bytes(head, "little")])
        finally:
            conn.close()

    def client(self):
        c = socket.create_connection(("127.0.0.1", self.port))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(64 << 20)

        def call(n: int):
            c.sendall(n.to_bytes(8, "little"))
            view, got = memoryview(buf), 0
            while got < n:
                got += c.recv_into(view[got:n])

        return c, call

    def close(self):
        self.sock.close()


def call_times(fn, seconds: float, min_calls: int = 5) -> list[float]:
    times, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < min_calls:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _atari_shard(obs, items: int, wire: int | None, integrity: bool = True, tls: str = "",
                 profile: bool = False, keep_digests: bool = True, tls_records: str = "gearflow") -> ShardProcess:  # fmt: skip
    """A shard process holding ``items`` 2-step transitions of uint8 ``obs`` rows."""
    spec = {"obs": f"uint8[{','.join(map(str, obs))}]", "action": "int64", "ret": "float32", "disc": "float32",
            "version": "int64"}  # fmt: skip
    shard = ShardProcess(spec, 4, items // 4 + 8, wire=wire, integrity=integrity, tls=tls, profile=profile,
                         keep_digests=keep_digests, tls_records=tls_records)  # fmt: skip
    w = RemoteWriter(Client(("127.0.0.1", shard.port), TOKEN, integrity=integrity, tls=tls, tls_records=tls_records),
                     num_streams=4, token=TOKEN)  # fmt: skip
    k = items // 4
    rng = np.random.default_rng(0)
    for s in range(4):
        w.extend({"obs": rng.integers(0, 255, (k, *obs), dtype=np.uint8), "action": np.arange(k),
                  "ret": np.zeros(k, np.float32), "disc": np.zeros(k, np.float32), "version": np.zeros(k, np.int64)},
                 stream=s)  # fmt: skip
        w.create_items(np.ones(k - 1), 2, streams=s, ends=np.arange(2, k + 1))
    w.close()
    return shard


def sample(seconds: float = 2.0, batch: int = 256, obs=(4, 84, 84), items: int = 4096, rounds: int = 5) -> dict:
    """RemoteSampler batches against the raw socket moving the same bytes, in ``rounds``
    alternating slices; the ratio is the median of the per-round ratios. Shards in the same
    rounds: integrity on (the default: the MAC over the rows' kept digests), off, both with rows
    out of the segment, and off and gathered (``wire_min_row_bytes=None``): ``ratio``,
    ``ratio_no_integrity``, ``ratio_gathered``; integrity on with every draw's row digests
    computed afresh (the cost when every row drawn is drawn for the first time: ``ratio_fresh_rows``,
    ``integrity_cost_fresh_rows``) and with no row digests (the MAC reads the rows at every send:
    ``ratio_rows_maced``, ``integrity_cost_rows_maced``); and over TLS where ``openssl`` is installed:
    gearflow's records under the TLS handshake (the default: ``ratio_tls``) and TLS's own records
    (``transport.tls_records=tls``: ``ratio_tls_records``)."""
    import shutil
    import tempfile

    shards, samplers = [], []
    raw = _RawServer()
    c = None
    tls_dir = None
    # (wire_min_row_bytes, integrity, tls, the shard keeps row digests, the learner asks for them, tls_records)
    variants = [(1024, True, "", True, True, "gearflow"), (1024, False, "", True, True, "gearflow"),
                (None, False, "", True, True, "gearflow"), (1024, True, "", False, True, "gearflow"),
                (1024, True, "", True, False, "gearflow")]  # fmt: skip
    if shutil.which("openssl"):  # and over mutual TLS (integrity on too: the default with transport.tls)
        from gearflow.transport.tls import init

        tls_dir = tempfile.mkdtemp(prefix="gearflow-bench-tls-")
        init(tls_dir)
        variants += [(1024, True, tls_dir, True, True, "gearflow"), (1024, True, tls_dir, True, True, "tls")]
    try:
        for wire, integrity, tls, keep, digests, records in variants:
            shards.append(_atari_shard(obs, items, wire, integrity, tls, keep_digests=keep, tls_records=records))
            client = Client(("127.0.0.1", shards[-1].port), TOKEN, integrity=integrity, tls=tls, tls_records=records)
            client.row_digests = client.row_digests and digests
            samplers.append(RemoteSampler([client], token=TOKEN, prefetch=LEARNER_PREFETCH))
        b0 = samplers[0].sample(batch)  # as a learner samples: LEARNER_PREFETCH rounds ahead
        for sm in samplers[1:]:
            sm.sample(batch)
        nbytes = sum(t.numel() * t.element_size() for t in [*b0.data.values(), b0.keys, b0.weights, b0.probabilities])
        c, call = raw.client()
        remote, plain, gathered, floor, fresh, maced, tls_rates, tls_records = [], [], [], [], [], [], [], []
        for r in range(rounds):
            paths = [(remote, lambda: samplers[0].sample(batch)), (plain, lambda: samplers[1].sample(batch)),
                     (gathered, lambda: samplers[2].sample(batch)), (floor, lambda: call(nbytes)),
                     (fresh, lambda: samplers[3].sample(batch)), (maced, lambda: samplers[4].sample(batch))]  # fmt: skip
            if tls_dir:
                paths += [(tls_rates, lambda: samplers[5].sample(batch)), (tls_records, lambda: samplers[6].sample(batch))]
            k = r % len(paths)
            for out, fn in paths[k:] + paths[:k]:
                t = call_times(fn, seconds / rounds)
                out.append(len(t) / sum(t))
    finally:
        for sm in samplers:
            sm.close()
        if c is not None:
            c.close()
        raw.close()
        for sh in shards:
            sh.close()
        if tls_dir:
            shutil.rmtree(tls_dir, ignore_errors=True)
    tls_out = {}
    if tls_rates:
        tls_out = {"tls_gb_per_s": float(np.median(tls_rates)) * nbytes / 1e9,
                   "ratio_tls": float(np.median(np.array(tls_rates) / np.array(floor))),
                   "tls_records_gb_per_s": float(np.median(tls_records)) * nbytes / 1e9,
                   "ratio_tls_records": float(np.median(np.array(tls_records) / np.array(floor)))}  # fmt: skip
    r, p, g, f = (float(np.median(x)) for x in (remote, plain, gathered, floor))
    remote, plain, gathered, floor, fresh, maced = (np.array(x) for x in (remote, plain, gathered, floor, fresh, maced))
    return {"bench": "transport/sample", "batch": batch, "bytes_per_batch": nbytes, "rounds": rounds,
            "remote_batches_per_s": r, "remote_gb_per_s": r * nbytes / 1e9, "raw_socket_batches_per_s": f,
            "raw_socket_gb_per_s": f * nbytes / 1e9, "no_integrity_gb_per_s": p * nbytes / 1e9,
            "gathered_gb_per_s": g * nbytes / 1e9,
            "ratio": float(np.median(remote / floor)), "ratio_no_integrity": float(np.median(plain / floor)),
            "ratio_gathered": float(np.median(gathered / floor)),
            "integrity_cost": float(np.median(1 - remote / plain)),
            "ratio_fresh_rows": float(np.median(fresh / floor)), "integrity_cost_fresh_rows": float(np.median(1 - fresh / plain)),
            "ratio_rows_maced": float(np.median(maced / floor)), "integrity_cost_rows_maced": float(np.median(1 - maced / plain)),
            **tls_out}  # fmt: skip


def _thread_kind(name: str) -> str:
    """A thread's name without what differs per run (a client's address, a pool worker's index)."""
    import re

    return re.sub(r"(-\d+\.\d+\.\d+\.\d+:\d+|_\d+)$", "", name)


def sample_profile(rounds: int = 40, batch: int = 256, obs=(4, 84, 84), items: int = 4096, repeats: int = 2) -> Iterator[dict]:
    """Where one ``sample`` round's time goes, integrity on and off, on both sides
    (:class:`~gearflow.transport.profile.PhaseProfile`: the learner's phases in this process, the
    shard's in its own): per round, each phase's calls, items (MAC update calls; bytes received),
    wall and CPU ms, and each thread's CPU ms; the variants alternate ``repeats`` times,
    ``rounds`` rounds each, after 5 unprofiled-in-the-sum rounds. One row per variant:
    ``{"bench": "transport/profile", "integrity", "round_ms", "shard": {...}, "learner": {...}}``
    with ``{"phases": {phase: {calls, items, wall_ms, cpu_ms}}, "threads": {name: cpu_ms}}`` per side."""
    from gearflow.transport.profile import PhaseProfile

    prof = PhaseProfile().install()
    shards, samplers = {}, {}
    sums: dict[bool, dict] = {}
    try:
        for integrity in (True, False):
            shards[integrity] = _atari_shard(obs, items, 1024, integrity, profile=True)
            client = Client(("127.0.0.1", shards[integrity].port), TOKEN, integrity=integrity)
            samplers[integrity] = RemoteSampler([client], token=TOKEN, prefetch=LEARNER_PREFETCH)
            sums[integrity] = {"rounds": 0, "wall_ns": 0, "shard": {}, "learner": {}}
        for rep in range(repeats):
            for integrity in ((True, False) if rep % 2 == 0 else (False, True)):
                sm, sh = samplers[integrity], shards[integrity]
                for _ in range(5):
                    sm.sample(batch)
                sh.profile()
                prof.reset()
                t0 = time.perf_counter_ns()
                for _ in range(rounds):
                    sm.sample(batch)
                wall = time.perf_counter_ns() - t0
                learner, shard = prof.read(), sh.profile()
                acc = sums[integrity]
                acc["rounds"] += rounds
                acc["wall_ns"] += wall
                for side, got in (("shard", shard), ("learner", learner)):
                    a = acc[side]
                    for phase, v in got["phases"].items():
                        p = a.setdefault("phases", {}).setdefault(phase, {"calls": 0, "items": 0, "wall_ns": 0, "cpu_ns": 0})
                        for k in p:
                            p[k] += v[k]
                    for name, ns in got["threads"].items():
                        t = a.setdefault("threads", {})
                        t[_thread_kind(name)] = t.get(_thread_kind(name), 0) + ns
    finally:
        prof.uninstall()
        for sm in samplers.values():
            sm.close()
        for sh in shards.values():
            sh.close()
    for integrity, acc in sums.items():
        n = acc["rounds"]
        row = {"bench": "transport/profile", "integrity": integrity, "batch": batch, "rounds": n,
               "round_ms": acc["wall_ns"] / n / 1e6}  # fmt: skip
        for side in ("shard", "learner"):
            a = acc[side]
            row[side] = {
                "phases": {k: {"calls": v["calls"] / n, "items": v["items"] / n, "wall_ms": v["wall_ns"] / n / 1e6,
                               "cpu_ms": v["cpu_ns"] / n / 1e6} for k, v in sorted(a.get("phases", {}).items())},
                "threads": {k: ns / n / 1e6 for k, ns in sorted(a.get("threads", {}).items(), key=lambda x: -x[1])
                            if ns / n >= 1e4},  # threads busy ≥ 10 µs a round
            }  # fmt: skip
        yield row


_SMALL = {"obs": "float32[4]", "action": "int64", "ret": "float32", "disc": "float32", "version": "int64"}


def _small_shard(k: int) -> ShardProcess:
    """A prioritized shard process holding 2 streams of ``k`` small steps (2-step items, priority 1)."""
    shard = ShardProcess(_SMALL, 2, k + 96, selector="prioritized")
    w = RemoteWriter(("127.0.0.1", shard.port), num_streams=2, token=TOKEN)
    for s in range(2):
        w.extend({"obs": np.zeros((k, 4), np.float32), "action": np.arange(k), "ret": np.zeros(k, np.float32),
                  "disc": np.zeros(k, np.float32), "version": np.zeros(k, np.int64)}, stream=s)  # fmt: skip
        w.create_items(np.ones(k - 1), 2, streams=s, ends=np.arange(2, k + 1))
    w.close()
    return shard


def latency(seconds: float = 1.0, batches=(32, 256)) -> Iterator[dict]:
    shard = _small_shard(4000)
    port = shard.port
    raw = _RawServer()
    try:
        sampler = RemoteSampler(("127.0.0.1", port), token=TOKEN, prefetch=0)
        c, call = raw.client()
        for b in batches:
            b0 = sampler.sample(b)
            nbytes = sum(t.numel() * t.element_size() for t in [*b0.data.values(), b0.keys, b0.weights, b0.probabilities])
            lat = np.array(call_times(lambda b=b: sampler.sample(b), seconds)) * 1e6
            fl = np.array(call_times(lambda n=nbytes: call(n), seconds)) * 1e6
            yield {"bench": "transport/latency", "batch": b, "bytes": nbytes,
                   "p50_us": float(np.percentile(lat, 50)), "p99_us": float(np.percentile(lat, 99)),
                   "raw_socket_p50_us": float(np.percentile(fl, 50)), "raw_socket_p99_us": float(np.percentile(fl, 99))}  # fmt: skip
        c.close()
        sampler.close()
    finally:
        raw.close()
        shard.close()


def _learner_loop(sampler: RemoteSampler, batch: int, learn_s: float, seconds: float, wait: bool) -> float:
    """Updates/s of a learner's loop: batches from a Prefetcher thread (under the learner's
    lock, as the learner samples), a learn step of ``learn_s`` (a sleep), the priorities
    written back under the lock."""
    from gearflow.learner import Prefetcher

    lock, stop = threading.Lock(), threading.Event()
    rng = np.random.default_rng(0)
    pre = Prefetcher(sampler, lock, batch, 2, stop)
    try:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds or n < 5:
            b = pre.get(timeout=60)
            time.sleep(learn_s)
            with lock:
                sampler.update_priorities(b.keys, rng.random(batch) + 0.1, wait=wait)
            n += 1
        return n / (time.perf_counter() - t0)
    finally:
        pre.close()


def writeback(seconds: float = 2.0, rtt_ms: float = 10.0, learn_ms: float = 10.0, batch: int = 64,
              rounds: int = 4) -> dict:  # fmt: skip
    """A learner over two prioritized shard processes, each behind a relay adding ``rtt_ms`` to
    the round trip, learning ``learn_ms`` per batch (a sleep: the link is measured, not this
    machine's cores): updates/s with the write-back not waiting (the default) and waiting for
    every reply (``wait=True``: the floor), alternating rounds; the write-back's round trip
    overlapping the learn step predicts (learn + rtt) / max(learn, rtt) as the ratio."""
    from gearflow.transport.relay import Relay

    shards, relays, sampler = [], [], None
    try:
        for _ in range(2):
            shards.append(_small_shard(2000))
            relays.append(Relay(f"127.0.0.1:{shards[-1].port}", rtt_ms))
        sampler = RemoteSampler([r.address for r in relays], token=TOKEN, prefetch=LEARNER_PREFETCH, seed=0)
        rates: dict[bool, list] = {False: [], True: []}
        for r in range(rounds):
            for wait in (False, True) if r % 2 == 0 else (True, False):
                rates[wait].append(_learner_loop(sampler, batch, learn_ms / 1e3, seconds / rounds, wait))
    finally:
        if sampler is not None:
            sampler.close()
        for x in relays + shards:
            x.close()
    new, old = np.array(rates[False]), np.array(rates[True])
    return {"bench": "transport/writeback", "batch": batch, "rtt_ms": rtt_ms, "learn_ms": learn_ms, "rounds": rounds,
            "updates_per_s": float(np.median(new)), "waiting_updates_per_s": float(np.median(old)),
            "ratio": float(np.median(new / old)),
            "overlap_predicts": (learn_ms + rtt_ms) / max(learn_ms, rtt_ms, 1e-9)}  # fmt: skip


def actor(steps: int = 20_000, num_envs: int = 16, batch: int = 8) -> dict:
    """The Ape-X actor itself (EnvPool CartPole, the apex_dqn agent, one torch thread): env
    steps/s writing a local shared-memory table, through a RemoteWriter, and through a
    ShippingWriter into a shard process (the issue's "same actor writing shared memory")."""
    import torch

    from gearflow.actors import actor_class_for
    from gearflow.actors.base import actor_epsilon
    from gearflow.agent import make_agent
    from gearflow.config import load_config
    from gearflow.envs import make_vec_env

    cfg = load_config(None, ["env.id=CartPole-v1", f"env.num_envs={num_envs}", f"env.batch_size={batch}",
                             "actor.num_actors=1", "replay.capacity=65536"])  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rates = {}
    try:
        for where in ("local", "remote", "shipping"):
            env = make_vec_env(cfg.env, seed=0)
            agent = make_agent(cfg, env.env_spec, torch.device("cpu"))
            spec = agent.replay_columns()
            spec = spec.to_dict() if hasattr(spec, "to_dict") else spec
            shard = storage = None
            if where == "local":
                storage = SharedStorage.create(TableSpec.parse(spec), num_envs, 4096)
                w = Writer(storage, np.arange(num_envs))
            else:
                shard = ShardProcess(spec, num_envs, 4096)
                w = (RemoteWriter if where == "remote" else ShippingWriter)(("127.0.0.1", shard.port), num_streams=num_envs,
                                                                            token=TOKEN)  # fmt: skip
            try:
                a = actor_class_for(agent)(env, agent, w, None, actor_epsilon(cfg, 0, num_envs), cfg=cfg.actor,
                                           env_cfg=cfg.env, seed=0)
                a.run(max_steps=steps // 10)  # warm-up
                t0 = time.perf_counter()
                n = a.run(max_steps=steps)
                rates[where] = n / (time.perf_counter() - t0)
                a.close()
            finally:
                if shard is not None:
                    w.close()
                    shard.close()
                else:
                    storage.close()
                    storage.unlink()
    finally:
        torch.set_num_threads(threads)
    return {"bench": "transport/actor", "env": "CartPole-v1", "envs": num_envs, "recv_batch": batch,
            "local_steps_per_s": rates["local"], "remote_writer_steps_per_s": rates["remote"],
            "shipping_writer_steps_per_s": rates["shipping"], "remote_ratio": rates["remote"] / rates["local"],
            "shipping_ratio": rates["shipping"] / rates["local"]}  # fmt: skip


def run_all(seconds: float = 2.0) -> Iterator[dict]:
    yield insert(seconds)
    yield actor()
    yield sample(seconds)
    yield from latency(seconds / 2)
    yield writeback(seconds)


if __name__ == "__main__":
    import json
    import sys

    for row in run_all(float(sys.argv[1]) if len(sys.argv) > 1 else 2.0):
        print(json.dumps(row), flush=True)

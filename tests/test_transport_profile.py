"""The transport's phase profile (``gearflow bench transport --profile``) counts what it says."""

from __future__ import annotations

import numpy as np

from gearflow.transport import integrity
from gearflow.transport.framing import REQUEST, encode
from gearflow.transport.profile import PhaseProfile, thread_cpu_ns


def test_profile_counts_mac_update_calls_and_is_removed_whole():
    before = (integrity._Mac.update, integrity._Mac.update_spans, integrity.Opener.check)
    prof = PhaseProfile().install()
    try:
        seal, opener = integrity.Sealer(bytes(32)), integrity.Opener(bytes(32))
        rows = np.arange(3 * 1024, dtype=np.uint8)
        spans: list = []
        parts = encode(REQUEST, 1, "x", {}, [rows], spans=spans)
        seal.begin()
        seal.update_spans(spans)  # the header and the buffer: 2 update calls in one Python call
        trailer = seal.trailer()
        opener.begin()
        for p in parts:
            opener.update(p)  # one call each
        opener.check(trailer)
        got = prof.read()
    finally:
        prof.uninstall()
    mac = got["phases"]["mac"]
    assert mac["calls"] == 1 + len(parts) and mac["items"] == len(spans) + len(parts)
    assert mac["wall_ns"] > 0 and got["phases"]["check"]["calls"] == 1
    assert "MainThread" in got["threads"]
    assert (integrity._Mac.update, integrity._Mac.update_spans, integrity.Opener.check) == before


def test_thread_cpu_names_python_threads():
    assert thread_cpu_ns()["MainThread"] > 0

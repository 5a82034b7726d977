"""Secrets stay secret (issue #32, point 6), through the real ``gearflow train`` and
``gearflow actor`` processes: the token is in no process's command line, in no file of the run
directory (config.yaml, checkpoints/*/runner.json, logs, metrics), and not in anything the
learner sends a joining actor (a relay between them records every byte); the run directory
and its checkpoints are 0700, its files 0600."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gearflow.config import load_config, save_config
from gearflow.run.private import config_token, redacted
from tests.helpers_relay import LoopbackRelay
from tests.test_remote_actors import _finish, _wait_for
from tests.test_train import CONFIG, ROOT, TINY

SECRET = "s3cret-that-must-not-leak-4242"


class _Relay(LoopbackRelay):
    """A TCP relay on loopback to ``upstream``: records every byte the upstream sends back."""

    def __init__(self, upstream: tuple[str, int]):
        self.received, self.lock = bytearray(), threading.Lock()
        super().__init__(upstream)

    def pump(self, src, dst, direction: str, state=None) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if direction == "s2c":
                    with self.lock:
                        self.received += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self.shut(src, dst)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GEARFLOW_TOKEN"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return env


def _cmdlines_with(secret: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if secret.encode() in raw:
            line = raw.replace(bytes(1), b" ").decode(errors="replace")
            found.append(f"{pid}: {line[:200]}")
    return found


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_token_stays_out_of_ps_the_run_directory_and_the_wire(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    token_file.chmod(0o600)
    run_dir = tmp_path / "run"
    # the run's only actor is the remote one: the run cannot end before it joined (a local actor
    # reached 6000 steps before the remote one's process had started, once the learner ran at ~600
    # updates/s)
    # the learner's CONFIG file holds the secret (transport.token: what redaction must keep out of
    # the run directory and the run.join reply); the actor reads it from a 0600 file; the
    # environment has none
    from omegaconf import OmegaConf

    config = tmp_path / "with_token.yaml"
    OmegaConf.save(OmegaConf.merge(OmegaConf.load(CONFIG), {"transport": {"token": SECRET}}), config)
    config.chmod(0o600)
    log = tmp_path / "train.err"
    learner = subprocess.Popen([sys.executable, "-m", "gearflow", "train", str(config), *TINY, "run.progress=log",
                                f"run.dir={run_dir}", "actor.num_actors=1", "actor.remote_actors=1",
                                "run.max_env_steps=6000"],
                               stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=ROOT, env=_env())  # fmt: skip
    relay = None
    actor = None
    try:
        m = _wait_for(log, r"on 127\.0\.0\.1:(\d+): run gearflow actor --connect", learner)
        relay = _Relay(("127.0.0.1", int(m.group(1))))
        actor_log = tmp_path / "actor.err"
        actor = subprocess.Popen([sys.executable, "-m", "gearflow", "actor", "--connect", f"127.0.0.1:{relay.port}",
                                  "--token-file", str(token_file), "--actors", "1"],
                                 stdout=subprocess.DEVNULL, stderr=open(actor_log, "w"), cwd=ROOT, env=_env())  # fmt: skip
        _wait_for(log, r"remote actor \d+ joined", learner)
        assert _cmdlines_with(SECRET) == []  # no process has it on its command line (ps)
        code, out = _finish(learner, timeout=600)
        assert code == 0, log.read_text()[-3000:]
        assert actor.wait(timeout=240) == 0, actor_log.read_text()[-3000:]
    finally:
        for p in (learner, actor):
            if p is not None and p.poll() is None:
                p.kill()
        if relay is not None:
            relay.close()
    # the joiner got its place and the run's config, never the secret
    with relay.lock:
        wire = bytes(relay.received)
    # the relay saw the join reply (its partitions and the run's config: only the learner sends them)
    assert b"run.join" in wire and b"partitions" in wire and b'"config"' in wire
    assert SECRET.encode() not in wire
    # every file of the run directory: no secret; the directories 0700, the files 0600
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "runner.json" for p in files) and (run_dir / "config.yaml").is_file()
    for p in files:
        assert SECRET.encode() not in p.read_bytes(), p
        assert stat.S_IMODE(p.stat().st_mode) & 0o077 == 0, (p, oct(p.stat().st_mode))
    for d in [run_dir, *(p for p in run_dir.rglob("*") if p.is_dir())]:
        assert stat.S_IMODE(d.stat().st_mode) & 0o077 == 0, (d, oct(d.stat().st_mode))


def test_a_token_override_or_flag_warns_and_is_redacted(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = load_config(CONFIG, [f"transport.token={SECRET}"])
    assert any("visible to every user" in r.getMessage() for r in caplog.records)
    assert cfg.transport.token == SECRET  # still used by this process ...
    path = save_config(cfg, tmp_path / "config.yaml")
    assert SECRET not in path.read_text()  # ... never written
    assert redacted(cfg).transport.token == "" and cfg.transport.token == SECRET
    from gearflow.cli import _cli_token

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert _cli_token(argparse.Namespace(token=SECRET, token_file=None)) == SECRET
    assert any("--token-file" in r.getMessage() for r in caplog.records)


def test_a_token_file_readable_by_others_is_refused(tmp_path):
    from gearflow.errors import ConfigError

    f = tmp_path / "token"
    f.write_text(SECRET)
    f.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        config_token({"token_file": str(f)})
    f.chmod(0o600)
    assert config_token({"token_file": str(f)}) == SECRET
    assert config_token({"token": "direct-one", "token_file": str(f)}) == "direct-one"
    assert config_token({"token": "", "token_file": ""}) is None


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* write them) listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, _, p = local.rpartition(":")
            if state == "0A" and int(p, 16) == port:
                out.append(addr)
    return out


def test_rank_zeros_store_listens_on_its_address_only():
    """torch's own tcp:// rendezvous listens on every interface; rank 0's store here binds
    learner.dist_address's host only (Ray: the node's cluster address)."""
    import torch.distributed as dist

    from gearflow.distributed import DataParallel

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    group = DataParallel(0, 1, f"127.0.0.1:{port}", "gloo", "cpu", timeout_s=60).init()
    try:
        assert _listening(port) == ["0100007F"], _listening(port)  # 127.0.0.1, not 00000000 (every interface)
    finally:
        group.close()
        assert not dist.is_initialized()

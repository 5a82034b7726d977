"""Emulated hosts on one machine: network + mount + UTS namespaces joined by a Linux bridge.

Each host is a network namespace with one veth on a bridge (no route out: only the subnet the
caller names), and a holder process that owns the host's mount and UTS namespaces, in which
``/dev/shm`` and ``/tmp/ray`` are private tmpfs mounts, the host's own run folder is bind-mounted
at ``/tmp/gearflow-host`` (``HOST_DIR``: the same path names a different folder on each host, as
a local disk would) and the hostname is the host's name.
A command "on host i" is ``nsenter`` into the holder's namespaces (the returned ``Popen`` is the
command itself: kill it and the process dies). Links can be shaped: a rate with ``tc qdisc tbf``
on both ends of a host's veth, and a delay with a delaying TCP relay (this kernel has no
``netem``), started on the client's host in front of one server address.

As a module (tests, scripts)::

    from launch.hosts import Hosts
    with Hosts(3, subnet="10.231.1.0/24", name="gfa") as hosts:   # up; down on exit / atexit
        node = hosts[0].popen(["gearflow", "serve", ...], stdout=subprocess.PIPE)
        hosts[1].run(["ls", "/dev/shm"])                           # CompletedProcess
        relay = hosts.relay(2, f"{hosts[0].address}:5000", delay_ms=2.0)  # "10.231.1.13:40123"

As a command (operators)::

    python launch/hosts.py up 3 --subnet 10.231.1.0/24 --rate-mbit 200 [--name gfh]
    python launch/hosts.py exec 1 -- ls /dev/shm         # on host 1
    python launch/hosts.py relay 2 10.231.1.11:5000 --delay-ms 2   # prints the relay's address
    python launch/hosts.py rtt 0 1 [--delay-ms 2]        # TCP round trip host 0 → host 1
    python launch/hosts.py down [--name gfh]

Needs root, ``ip`` (iproute2), ``nsenter`` and ``unshare`` (util-linux). Teardown kills every
process in the hosts' network namespaces, deletes the namespaces (their veths go with them) and
the bridge; the private mounts go with the last process of each mount namespace.
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HOST_DIR = "/tmp/gearflow-host"  # on each host, its own run folder (Host.dir on this machine)
STATE_DIR = Path("/run/gearflow-hosts")  # the CLI's record of hosts it brought up (name.json)
NETNS_DIR = Path("/run/netns")


def available() -> str | None:
    """None when emulated hosts can be made here, else the reason they cannot (one line)."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, mounts)"
    for tool in ("ip", "nsenter", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"emulated hosts need `{tool}` on PATH"
    probe = f"gfprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), check=False, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc


# The holder: the host's mount + UTS namespaces live as long as it does. It prints one line
# once /dev/shm and /tmp/ray are private and empty and its folder is at HOST_DIR, then sleeps until killed.
_HOLDER = (
    "set -e; mount --make-rprivate /; "
    "mount -t tmpfs -o mode=1777,size={shm} gfshm /dev/shm; "
    "mkdir -p /tmp/ray; mount -t tmpfs -o mode=1777 gfray /tmp/ray; "
    "mkdir -p {host_dir}; mount --bind {dir} {host_dir}; "
    "hostname {hostname}; ip link set lo up; echo ready; exec sleep infinity"
)


@dataclass
class Host:
    """One emulated host: its namespace, address, private folder and holder process."""

    index: int
    name: str  # the network namespace's name, also the host's hostname
    address: str  # its address on the bridge, inside the caller's subnet
    dir: Path  # its run folder (a plain folder on this machine's disk), seen on the host at HOST_DIR
    veth: str  # its interface inside the namespace ("eth0")
    peer: str  # the veth's other end, on the bridge
    holder: int = 0  # pid of the holder process (its mount and UTS namespaces)
    procs: list = field(default_factory=list, repr=False)

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run in this host's network, mount and UTS namespaces."""
        return ["nsenter", "-t", str(self.holder), "-n", "-m", "-u", "--", *map(str, argv)]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on this host (``subprocess.Popen`` keywords). Its pid is the command's."""
        proc = subprocess.Popen(self.argv(argv), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host to its end (``subprocess.run`` keywords; text output by default)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("check", False)
        return subprocess.run(self.argv(argv), **kwargs)  # noqa: PLW1510 (check is in kwargs)

    def pids(self) -> list[int]:
        """Every process in this host's network namespace (the holder included)."""
        out = _sh("ip", "netns", "pids", self.name, check=False).stdout
        return [int(p) for p in out.split()]

    def shm(self) -> list[str]:
        """Names in this host's private /dev/shm."""
        return sorted(self.run(["ls", "-A", "/dev/shm"], check=True).stdout.split())

    def kill(self) -> None:
        """The host dies whole: its cable pulled (the bridge's end of its veth down), then every
        process on it but the holder SIGKILLed (their sockets' FINs go nowhere). Its /dev/shm and
        folder stay, as a dead machine's disk does; ``Hosts.down()`` still removes it."""
        _sh("ip", "link", "set", self.peer, "down")
        for _ in range(200):
            pids = [p for p in self.pids() if p != self.holder]
            if not pids:
                return
            subprocess.run(["kill", "-9", *map(str, pids)], check=False, capture_output=True)
            time.sleep(0.02)
        raise RuntimeError(f"host {self.name}: processes {pids} outlived SIGKILL")


class Hosts:
    """``n`` emulated hosts on a bridge; ``up()`` / ``down()``, or use it as a context manager.

    ``subnet``: the only addresses the hosts get and reach (host i is the subnet's address
    11 + i; the bridge has none, so the hosts cannot reach this machine's own stack).
    ``name``: a short prefix (≤ 8 characters) for the bridge, namespaces and veths, unique per
    live set (two sets with distinct names and subnets coexist). ``rate_mbit``: a ``tbf`` rate
    on both ends of every host's veth (None: unshaped). ``shm_size``: each host's /dev/shm size.
    ``root``: where the hosts' run folders go (default: a fresh temporary folder, removed by
    ``down()``; a given one is kept).
    """

    def __init__(self, n: int, subnet: str = "10.231.0.0/24", name: str = "gfh", rate_mbit: float | None = None,
                 shm_size: str = "1g", root: str | Path | None = None):  # fmt: skip
        net = ipaddress.ip_network(subnet)
        if not net.subnet_of(ipaddress.ip_network("10.0.0.0/8")) or net.num_addresses < n + 16:
            raise ValueError(f"subnet {subnet}: give a private 10.x subnet with room for {n} hosts")
        if not (1 <= len(name) <= 8 and name.isalnum()):
            raise ValueError(f"name {name!r}: 1–8 letters or digits (interface names are ≤ 15 characters)")
        self.n, self.net, self.name, self.rate_mbit, self.shm_size = n, net, name, rate_mbit, shm_size
        self.bridge = f"{name}br"
        self._own_root = root is None
        self.root = Path(root) if root is not None else None
        self.hosts: list[Host] = []
        self._relays: list[subprocess.Popen] = []
        self._up = False

    # -- set up / tear down -------------------------------------------------------------------

    def up(self) -> Hosts:
        if self._up:
            return self
        atexit.register(self.down)
        self._up = True  # from here on down() undoes whatever part was made
        try:
            self._make()
        except BaseException:
            self.down()
            raise
        return self

    def _make(self) -> None:
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix=f"{self.name}-hosts-"))
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "link", "set", self.bridge, "up")
        prefix = self.net.prefixlen
        for i in range(self.n):
            ns = f"{self.name}{i}"
            host = Host(i, ns, str(self.net.network_address + 11 + i), self.root / ns, "eth0", f"{self.name}{i}b")
            host.dir.mkdir(parents=True, exist_ok=True)
            self.hosts.append(host)
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", host.peer, "type", "veth", "peer", "name", f"{self.name}{i}h")
            _sh("ip", "link", "set", f"{self.name}{i}h", "netns", ns)
            _sh("ip", "-n", ns, "link", "set", f"{self.name}{i}h", "name", host.veth)
            _sh("ip", "link", "set", host.peer, "master", self.bridge)
            _sh("ip", "link", "set", host.peer, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{host.address}/{prefix}", "dev", host.veth)
            _sh("ip", "-n", ns, "link", "set", host.veth, "up")
            if self.rate_mbit:
                self._shape(host)
            script = _HOLDER.format(shm=self.shm_size, hostname=ns, dir=shlex.quote(str(host.dir)),
                                    host_dir=HOST_DIR)  # fmt: skip
            holder = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "-m", "-u", "--propagation", "private",
                                       "sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      start_new_session=True)  # fmt: skip
            line = holder.stdout.readline()
            holder.stdout.close()
            if line.strip() != b"ready":
                holder.kill()
                holder.wait()
                raise RuntimeError(f"host {ns}: its namespaces did not come up (holder exited {holder.poll()})")
            host.holder = holder.pid  # ip netns exec and unshare exec: this pid is the sleep's
            host.procs.append(holder)

    def _shape(self, host: Host) -> None:
        """tbf at ``rate_mbit`` on both ends of the host's veth: its egress and its ingress."""
        rate = f"{self.rate_mbit}mbit"
        burst = str(max(32 * 1024, int(self.rate_mbit * 1e6 / 8 / 250)))  # ≥ rate / HZ (250 Hz kernels)
        for netns, dev in ((host.name, host.veth), (None, host.peer)):
            argv = ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                    "latency", "20ms"]  # fmt: skip
            _sh(*(["ip", "netns", "exec", netns, *argv] if netns else argv))

    def shape(self, rate_mbit: float | None) -> None:
        """Change every link's rate now (None: remove the shaping)."""
        self.rate_mbit = rate_mbit
        for host in self.hosts:
            if rate_mbit:
                self._shape(host)
            else:
                _sh("ip", "netns", "exec", host.name, "tc", "qdisc", "del", "dev", host.veth, "root", check=False)
                _sh("tc", "qdisc", "del", "dev", host.peer, "root", check=False)

    def down(self) -> None:
        """Kill every process on the hosts, delete their namespaces, veths and the bridge. Idempotent."""
        if not self._up:
            return
        self._up = False
        for proc in self._relays:
            if proc.poll() is None:
                proc.kill()
        for host in self.hosts:
            _kill_netns(host.name)
            for proc in host.procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        for host in self.hosts:
            _sh("ip", "netns", "del", host.name, check=False)
            _sh("ip", "link", "del", host.peer, check=False)  # gone with the netns, unless that failed
        _sh("ip", "link", "del", self.bridge, check=False)
        for proc in self._relays:
            proc.wait()
        if self._own_root and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
        atexit.unregister(self.down)

    def __enter__(self) -> Hosts:  # noqa: PYI034 (py310: no typing.Self)
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self):
        return iter(self.hosts)

    # -- latency ------------------------------------------------------------------------------

    def relay(self, src: int, target: str, delay_ms: float) -> str:
        """A delaying TCP relay on host ``src`` in front of ``target`` ("ip:port"): its address.

        Connect to the returned address from host ``src`` instead of ``target``: each byte
        reaches the other side ``delay_ms / 2`` later in each direction, so a request/reply
        costs ``delay_ms`` more round trip (on top of the link's own). The relay runs until
        ``down()``."""
        host = self.hosts[src]
        proc = host.popen([sys.executable, str(Path(__file__).resolve()), "_relay", host.address, target,
                           str(delay_ms)], stdout=subprocess.PIPE, text=True)  # fmt: skip
        line = proc.stdout.readline().strip()
        if not line:
            raise RuntimeError(f"relay on {host.name} → {target}: exited {proc.wait()}")
        self._relays.append(proc)
        return line


def _kill_netns(ns: str) -> None:
    """SIGKILL every process in network namespace ``ns`` until none is left."""
    if not (NETNS_DIR / ns).exists():
        return
    for _ in range(200):
        pids = [int(p) for p in _sh("ip", "netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


# -- the delaying relay (runs on a host, as ``hosts.py _relay BIND TARGET DELAY_MS``) ----------


def _relay_main(bind: str, target: str, delay_ms: float) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's gearflow
    from gearflow.transport.relay import main  # the relay itself (also the transport bench's)

    main(bind, target, delay_ms)


# -- round trip probe (``hosts.py _echo`` / ``_ping``) -----------------------------------------


def _echo_main(bind: str) -> None:
    s = socket.create_server((bind, 0))
    print(f"{bind}:{s.getsockname()[1]}", flush=True)
    conn, _ = s.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(1 << 16):
        conn.sendall(data)


def _ping_main(target: str, rounds: int, size: int) -> None:
    host, port = target.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=10)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = b"x" * size
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        conn.sendall(payload)
        got = 0
        while got < size:
            got += len(conn.recv(1 << 16))
        times.append(time.perf_counter() - t)
    times.sort()
    print(json.dumps({"rtt_ms_median": 1e3 * times[len(times) // 2], "rtt_ms_min": 1e3 * times[0],
                      "rounds": rounds, "bytes": size}))  # fmt: skip


def rtt(hosts: Hosts, src: int, dst: int, delay_ms: float = 0.0, rounds: int = 200, size: int = 64) -> dict:
    """The TCP request/reply round trip from host ``src`` to host ``dst`` (through a relay of
    ``delay_ms`` when > 0): {"rtt_ms_median", "rtt_ms_min", ...}."""
    here = str(Path(__file__).resolve())
    echo = hosts[dst].popen([sys.executable, here, "_echo", hosts[dst].address], stdout=subprocess.PIPE, text=True)
    relays = len(hosts._relays)
    try:
        target = echo.stdout.readline().strip()
        if delay_ms > 0:
            target = hosts.relay(src, target, delay_ms)
        out = hosts[src].run([sys.executable, here, "_ping", target, str(rounds), str(size)], check=True, timeout=120)
        return json.loads(out.stdout)
    finally:
        for proc in [echo, *hosts._relays[relays:]]:
            proc.kill()
            proc.wait()
        del hosts._relays[relays:]


# -- the command line ---------------------------------------------------------------------------


def _load(name: str) -> Hosts:
    path = STATE_DIR / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"hosts.py: no hosts named {name!r} are up (no {path})")
    state = json.loads(path.read_text())
    hosts = Hosts(state["n"], state["subnet"], name, state["rate_mbit"], root=state["root"])
    hosts._own_root = state["own_root"]
    hosts.hosts = [Host(h["index"], h["name"], h["address"], Path(h["dir"]), h["veth"], h["peer"], h["holder"])
                   for h in state["hosts"]]  # fmt: skip
    hosts._up = True  # down() may undo them; nothing is registered with atexit
    return hosts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hosts.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="gfh", help="prefix of the bridge, namespaces and veths (≤ 8)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("up", help="bring up N hosts (they stay up until `down`)")
    p.add_argument("n", type=int)
    p.add_argument("--subnet", default="10.231.0.0/24")
    p.add_argument("--rate-mbit", type=float, default=None)
    p.add_argument("--root", default=None, help="folder for the hosts' run folders (default: a temporary one)")
    sub.add_parser("down", help="kill everything on the hosts and remove them")
    sub.add_parser("list", help="the hosts: name, address, run folder")
    p = sub.add_parser("exec", help="run a command on host I")
    p.add_argument("i", type=int)
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p = sub.add_parser("relay", help="a delaying relay on host I in front of TARGET (runs in the foreground)")
    p.add_argument("i", type=int)
    p.add_argument("target")
    p.add_argument("--delay-ms", type=float, required=True)
    p = sub.add_parser("rtt", help="TCP round trip host SRC → host DST")
    p.add_argument("src", type=int)
    p.add_argument("dst", type=int)
    p.add_argument("--delay-ms", type=float, default=0.0)
    for hidden in ("_relay", "_echo", "_ping"):
        sub.add_parser(hidden).add_argument("rest", nargs="*")
    args = parser.parse_args(argv)

    if args.cmd == "_relay":
        _relay_main(args.rest[0], args.rest[1], float(args.rest[2]))
        return 0
    if args.cmd == "_echo":
        _echo_main(args.rest[0])
        return 0
    if args.cmd == "_ping":
        _ping_main(args.rest[0], int(args.rest[1]), int(args.rest[2]))
        return 0
    if args.cmd == "up":
        if (STATE_DIR / f"{args.name}.json").exists():
            raise SystemExit(f"hosts.py: hosts named {args.name!r} are already up (`down` first)")
        hosts = Hosts(args.n, args.subnet, args.name, args.rate_mbit, root=args.root).up()
        atexit.unregister(hosts.down)  # they outlive this command
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {"n": args.n, "subnet": args.subnet, "rate_mbit": args.rate_mbit, "root": str(hosts.root),
                 "own_root": hosts._own_root,
                 "hosts": [{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(h).items() if k != "procs"}
                           for h in hosts]}  # fmt: skip
        (STATE_DIR / f"{args.name}.json").write_text(json.dumps(state, indent=1))
        for h in hosts:
            print(f"{h.index} {h.name} {h.address} {h.dir}")
        return 0
    hosts = _load(args.name)
    if args.cmd == "down":
        hosts.down()
        (STATE_DIR / f"{args.name}.json").unlink(missing_ok=True)
        return 0
    if args.cmd == "list":
        for h in hosts:
            print(f"{h.index} {h.name} {h.address} {h.dir}")
        return 0
    if args.cmd == "exec":
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        os.execvp("nsenter", hosts[args.i].argv(argv))
    if args.cmd == "relay":
        host = hosts[args.i]
        os.execvp("nsenter", host.argv([sys.executable, str(Path(__file__).resolve()), "_relay", host.address,
                                        args.target, str(args.delay_ms)]))  # fmt: skip
    if args.cmd == "rtt":
        print(json.dumps(rtt(hosts, args.src, args.dst, args.delay_ms)))
        hosts._up = False  # the relay/echo it started are gone; the hosts stay
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""A delaying TCP relay: every byte a client sends reaches the target, and every byte back reaches
the client, ``delay_ms / 2`` after it arrived (a link's round trip of ``delay_ms`` on top of the
real one). Where the kernel has no ``netem`` this is how a latency is emulated: launch/hosts.py
runs one on an emulated host (``hosts.py relay``), ``gearflow bench transport --workloads
writeback`` one on loopback.

    with Relay("127.0.0.1:7000", delay_ms=4.0) as relay:     # a process of its own
        client = Client(relay.address, token)                  # "127.0.0.1:<port>"

    asyncio.run(serve("10.231.0.12", "10.231.0.11:7000", 2.0))  # prints "bind:port", serves forever
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import subprocess
import sys
import time

__all__ = ["Relay", "main", "serve"]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Forward ``reader`` → ``writer``, each chunk released ``delay_s`` after it arrived."""
    queue: asyncio.Queue = asyncio.Queue()
    clock = time.monotonic  # not loop.time(): uvloop's is cached per iteration and its timers round to ms

    async def release() -> None:
        while True:
            due, data = await queue.get()
            while (wait := due - clock()) > 0:  # a timer may fire up to 1 ms early: sleep again
                await asyncio.sleep(wait)
            if data is None:
                break
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(release())
    try:
        while data := await reader.read(1 << 16):
            queue.put_nowait((clock() + delay_s, data))
    except (ConnectionError, OSError):
        pass
    queue.put_nowait((clock() + delay_s, None))
    try:
        await sender
    except (ConnectionError, OSError):
        pass


async def start(bind: str, target: str, delay_ms: float) -> asyncio.AbstractServer:
    """The relay's server on ``bind`` (a free port), each connection relayed to ``target``."""
    host, port = target.rsplit(":", 1)
    one_way = delay_ms / 2000.0

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            tr, tw = await asyncio.open_connection(host, int(port))
        except OSError:
            w.close()
            return
        for s in (w.get_extra_info("socket"), tw.get_extra_info("socket")):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(_pipe(r, tw, one_way), _pipe(tr, w, one_way))

    return await asyncio.start_server(handle, bind, 0)


async def serve(bind: str, target: str, delay_ms: float) -> None:
    """Run a relay until cancelled; prints its ``bind:port`` first (what ``hosts.py relay`` reads)."""
    server = await start(bind, target, delay_ms)
    print(f"{bind}:{server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


class Relay:
    """A relay in a process of its own (``python -m gearflow.transport.relay``: its own GIL, as a
    router is not the learner's) in front of ``target`` (``host:port``), bound on loopback;
    :attr:`address` is where to connect."""

    def __init__(self, target: str, delay_ms: float, bind: str = "127.0.0.1", timeout_s: float = 60.0):
        self._proc = subprocess.Popen([sys.executable, "-m", "gearflow.transport.relay", bind, target, str(float(delay_ms))],
                                      stdout=subprocess.PIPE, text=True)  # fmt: skip
        line = ""
        if select.select([self._proc.stdout], [], [], timeout_s)[0]:
            line = self._proc.stdout.readline().strip()
        if not line:
            self.close()
            raise RuntimeError(f"the relay to {target} did not start (rc {self._proc.poll()})")
        self.address = line

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(bind: str, target: str, delay_ms: float) -> None:
    """Serve a relay until killed (uvloop where installed)."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(bind, target, delay_ms))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))

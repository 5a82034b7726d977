"""Optional mutual TLS under the transport (``transport.tls``): confidentiality on the wire.

``transport.tls`` names a directory holding ``ca.pem`` (the run's certificate authority),
``node.pem`` and ``node.key`` (this machine's certificate and key, signed by that CA);
``gearflow tls init DIR`` makes them (:func:`init`, with the ``openssl`` command). Both ends
present their certificate and require the other's to chain to the CA (mutual TLS, TLS ≥ 1.2,
the standard :mod:`ssl` module under asyncio or uvloop); host names are not checked — a
peer is trusted for holding a certificate of the run's CA. The secret handshake and frame
MACs (``auth.py``, ``integrity.py``) run inside it unchanged.

What carries the frames (``transport.tls_records``): ``gearflow`` (the default; with
``transport.integrity`` on) — TLS's handshake, then gearflow's records keyed inside it
(:mod:`gearflow.transport.records`: AES-128-CTR over every byte, the frame MAC on every frame,
read and decrypted by the client's wire thread as bytes land); ``tls`` — TLS's own records for
everything, through the loop's TLS transport (below). Measured (``gearflow bench transport
--workloads sample``): gearflow's records 0.45–0.55 of the raw socket (median 0.485 of 15 runs),
TLS's 0.28–0.34 in the same runs (``gearflow/transport/README.md``).

    gearflow tls init runs/tls                 # ca.pem, ca.key, node.pem, node.key
    gearflow tls init runs/tls --name box-b    # box-b/node.pem, box-b/node.key: copy box-b/ and ca.pem there
    gearflow train CONFIG transport.tls=runs/tls ...

Keep ``ca.key`` on the machine that makes certificates; a node needs ``ca.pem`` and its own pair.

With TLS's records, a big frame goes to the TLS transport in pieces of :data:`PIECE` bytes (:func:`pieces`): the
transport encrypts what it is given into OpenSSL's memory BIO and only then reads the BIO out to
the socket, so a 14.5 MB sample reply written at once grew that BIO to 14.5 MB (reallocated as
it grew, then copied out cold); in 256 KiB pieces each piece's records leave while they
are still in L2. Measured (``gearflow bench transport --workloads sample``'s TLS shard and sampler,
the raw socket in the same runs, 7 paired runs): 0.26–0.29 → 0.30–0.36 of the raw socket.
"""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

from gearflow.errors import GearflowError
from gearflow.transport.wire_io import PIECE as WIRE_PIECE

__all__ = ["PIECE", "TlsError", "client_context", "init", "pieces", "server_context"]

_FILES = ("ca.pem", "node.pem", "node.key")
PIECE = WIRE_PIECE  # bytes handed to a TLS transport at once: the wire thread's piece, within L2
_DAYS = "825"


class TlsError(GearflowError, ValueError):
    """The TLS files are missing or unusable; the message says which and how to make them."""


def _files(directory: str) -> tuple[str, str, str]:
    d = Path(directory)
    missing = [n for n in _FILES if not (d / n).is_file()]
    if missing:
        raise TlsError(f"transport.tls={directory}: {', '.join(missing)} missing there "
                       f"(make them with `gearflow tls init {directory}`)")  # fmt: skip
    return tuple(str(d / n) for n in _FILES)  # type: ignore[return-value]


def _context(directory: str, purpose) -> ssl.SSLContext:
    ca, cert, key = _files(directory)
    try:
        ctx = ssl.create_default_context(purpose, cafile=ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False  # a peer is trusted for its certificate from the run's CA
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise TlsError(f"transport.tls={directory}: cannot use its files ({exc})") from None
    return ctx


def server_context(directory: str) -> ssl.SSLContext:
    """The service's context: presents node.pem, requires a client certificate from ca.pem; no
    session tickets (nothing resumes a session, and no TLS message may follow the key exchange of
    gearflow's records: :mod:`gearflow.transport.records`)."""
    ctx = _context(directory, ssl.Purpose.CLIENT_AUTH)
    ctx.num_tickets = 0
    return ctx


def client_context(directory: str) -> ssl.SSLContext:
    """A client's context: presents node.pem, requires the service's certificate from ca.pem."""
    return _context(directory, ssl.Purpose.SERVER_AUTH)


def pieces(parts: list, size: int = PIECE) -> Iterator[list]:
    """``parts`` (bytes-like, each C-contiguous) as successive lists of views holding ``size``
    bytes each (the last one the rest), in order, without copying: a part longer than a piece
    is sliced across pieces."""
    group, held = [], 0
    for p in parts:
        v = memoryview(p).cast("B")  # bytes too: a slice of bytes would be a copy
        while len(v):
            take = min(len(v), size - held)
            group.append(v if take == len(v) else v[:take])
            held += take
            v = v[take:]
            if held == size:
                yield group
                group, held = [], 0
    if group:
        yield group


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise TlsError("gearflow tls init needs the openssl command (apt-get install openssl)")
    r = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise TlsError(f"openssl {args[0]} failed: {r.stderr.strip()[-400:]}")


def init(directory: str, name: str = "") -> list[str]:
    """Make the CA in ``directory`` (if it has none) and a node certificate: ``node.pem`` /
    ``node.key`` there, or under ``directory/name/`` (with a copy of ``ca.pem``) for another
    machine. Keys are written 0600. Returns the files written."""
    d = Path(directory).resolve()  # openssl runs in it: the paths handed to it must not be relative
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    made = []
    if not (d / "ca.pem").is_file():
        if (d / "ca.key").exists():
            raise TlsError(f"{d}: ca.key exists without ca.pem; remove it or restore ca.pem")
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout",
                 "ca.key", "-out", "ca.pem", "-days", _DAYS, "-subj", "/CN=gearflow run CA", cwd=d)  # fmt: skip
        os.chmod(d / "ca.key", 0o600)
        made += [str(d / "ca.pem"), str(d / "ca.key")]
    elif not (d / "ca.key").is_file():
        raise TlsError(f"{d}: ca.pem without ca.key: node certificates are made where the CA key is")
    out = d / name if name else d
    if name:
        if not name.replace("-", "").replace("_", "").isalnum():
            raise TlsError(f"a node name is letters, digits, '-' or '_', got {name!r}")
        out.mkdir(exist_ok=True)
        os.chmod(out, 0o700)
        shutil.copyfile(d / "ca.pem", out / "ca.pem")
    cn = name or "gearflow node"
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout",
             str(out / "node.key"), "-out", str(out / "node.csr"), "-subj", f"/CN={cn}", cwd=d)  # fmt: skip
    os.chmod(out / "node.key", 0o600)
    ext = out / "node.ext"
    ext.write_text("basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
                   "extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n")  # fmt: skip
    _openssl("x509", "-req", "-in", str(out / "node.csr"), "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", str(out / "node.pem"), "-days", _DAYS, "-extfile", str(ext), cwd=d)  # fmt: skip
    for tmp in (out / "node.csr", ext):
        tmp.unlink()
    return made + [str(out / "node.pem"), str(out / "node.key")]

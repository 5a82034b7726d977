"""Authentication of a connection (a mutual HMAC challenge-response), its role, and its
session keys.

    server → client   CHALLENGE {"nonce": sn (32 random bytes, hex), "version": 2, "integrity": bool}
    client → server   AUTH      {"nonce": cn, "role": "learner"|"actor", "name": actor name ("" for a
                                 learner), "integrity": bool, "limits": [max_frame_bytes,
                                 max_meta_bytes, max_buffers, max_dims] (optional),
                                 "mac": HMAC(K, "client" | transcript)}
    server → client   AUTH_OK   {"mac": HMAC(K, "server" | transcript)}      (or ERROR, then close)

    transcript = version | sn | cn | role | name | integrity [| limits]
    K          = the learner secret (role learner) or the actor secret of ``name`` (role actor)

``limits``: what the client accepts in a frame (its :class:`~gearflow.transport.framing.FrameLimits`;
absent: the defaults). The service keeps every reply within them (``Connection.peer_limits``: a
reply that would break them is an error reply naming the limit, and a reply that can grow, such
as ``run.progress``, is paged to fit), so a legitimate reply never makes the client drop the
connection. They are in the transcript: a relay can neither change nor add nor remove them.

Secrets and roles. The **learner secret** (``transport.token`` / ``$GEARFLOW_TOKEN`` / a file on
the learner's and the shard nodes' machines) can do everything. An **actor credential**
``gfa1.<name>.<hex>`` holds ``HMAC-SHA256(learner secret, "gearflow-actor-secret-v1|" + name)``
(:func:`actor_credential`; ``gearflow secret actor NAME`` prints one): an actor machine holds only
that. A service holds the learner secret and derives the actor secret of the name a client
claims; the connection's role is the one whose secret the client proved
(``Connection.role``), and the service serves it only the handlers of that role. The service's
answer proves it holds the same secret: a client with an actor credential of ``name`` can only be
convinced by a holder of that actor secret or of the learner's — so give each actor machine its
own name, and no actor machine can pose as the service to another.

Freshness. The server's nonce is fresh per connection, so a recorded AUTH is refused; the
client's makes the server's answer fresh too. Both compare with ``hmac.compare_digest``.
``integrity`` is part of the transcript: a relay cannot switch frame integrity off for one end,
and the two ends' settings must agree (a mismatch is refused with a message saying so). After
AUTH_OK every frame carries a MAC under :func:`frame_keys` (``integrity.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from gearflow.errors import GearflowError

__all__ = [
    "ACTOR",
    "LEARNER",
    "NONCE_BYTES",
    "PROTOCOL",
    "TOKEN_ENV",
    "AuthenticationError",
    "AuthorizationError",
    "Credential",
    "IntegrityMismatch",
    "TransportMismatch",
    "actor_credential",
    "client_mac",
    "configure",
    "credential",
    "default_integrity",
    "default_row_digests",
    "default_tls",
    "default_tls_records",
    "frame_keys",
    "new_nonce",
    "resolve_token",
    "server_mac",
    "set_default_integrity",
    "set_default_row_digests",
    "set_default_tls",
    "set_default_tls_records",
]  # fmt: skip

TOKEN_ENV = "GEARFLOW_TOKEN"
NONCE_BYTES = 32
MIN_TOKEN_CHARS = 8
PROTOCOL = 2  # the handshake's version (1: no roles, no frame integrity)
LEARNER, ACTOR = "learner", "actor"
ROLES = (LEARNER, ACTOR)
ACTOR_PREFIX = "gfa1."
_ACTOR_LABEL = b"gearflow-actor-secret-v1|"
MAX_NAME_CHARS = 64


class AuthenticationError(GearflowError, PermissionError):
    """A peer did not prove it holds the shared secret (wrong token, replayed handshake, or a
    service that is not the one configured)."""


class IntegrityMismatch(AuthenticationError):
    """The two ends disagree on ``transport.integrity``."""


class TransportMismatch(IntegrityMismatch):
    """The two ends disagree on how frames are carried under TLS (``transport.tls_records``, or
    ``transport.integrity``, which gearflow's records need)."""


class AuthorizationError(GearflowError, PermissionError):
    """The connection's role may not call this handler (an actor calling a learner's)."""


_integrity_default = True


INTEGRITY_ENV = "GEARFLOW_INTEGRITY"


def set_default_integrity(on: bool) -> None:
    """What ``Service`` / ``Client`` use when given ``integrity=None``: the entry points set it from
    ``transport.integrity``; it is also put in the environment (``$GEARFLOW_INTEGRITY``), so the
    processes they start (actors, the remote actors' service) agree."""
    global _integrity_default
    _integrity_default = bool(on)
    os.environ[INTEGRITY_ENV] = "1" if on else "0"


TLS_ENV = "GEARFLOW_TLS"
_tls_default = ""


def set_default_tls(directory: str) -> None:
    """What ``Service`` / ``Client`` use when given ``tls=None`` (``transport.tls``; ``""``: no TLS);
    also ``$GEARFLOW_TLS`` for the processes this one starts."""
    global _tls_default
    _tls_default = str(directory or "")
    os.environ[TLS_ENV] = _tls_default


def default_tls() -> str:
    env = os.environ.get(TLS_ENV)
    return env if env is not None else _tls_default


TLS_RECORDS_ENV = "GEARFLOW_TLS_RECORDS"
TLS_RECORDS = ("gearflow", "tls")
_tls_records_default = "gearflow"


def tls_records_mode(value: str) -> str:
    """``transport.tls_records`` checked: ``gearflow`` or ``tls``."""
    mode = str(value).strip().lower()
    if mode not in TLS_RECORDS:
        raise ValueError(f"transport.tls_records must be one of {', '.join(TLS_RECORDS)}, got {value!r}")
    return mode


def set_default_tls_records(mode: str) -> None:
    """What carries frames under TLS for ``Service`` / ``Client`` given ``tls_records=None``
    (``transport.tls_records``; :mod:`gearflow.transport.records`); also ``$GEARFLOW_TLS_RECORDS``."""
    global _tls_records_default
    _tls_records_default = tls_records_mode(mode)
    os.environ[TLS_RECORDS_ENV] = _tls_records_default


def default_tls_records() -> str:
    env = os.environ.get(TLS_RECORDS_ENV)
    return tls_records_mode(env) if env else _tls_records_default


ROW_DIGESTS_ENV = "GEARFLOW_ROW_DIGESTS"
_row_digests_default = True


def set_default_row_digests(on: bool) -> None:
    """Whether a ``Client`` asks for sample replies MACed by row digests (``transport.row_digests``);
    also ``$GEARFLOW_ROW_DIGESTS`` for the processes this one starts."""
    global _row_digests_default
    _row_digests_default = bool(on)
    os.environ[ROW_DIGESTS_ENV] = "1" if on else "0"


def default_row_digests() -> bool:
    env = os.environ.get(ROW_DIGESTS_ENV)
    if env is not None and env.strip().lower() in ("0", "false", "1", "true"):
        return env.strip().lower() in ("1", "true")
    return _row_digests_default


def configure(transport) -> None:
    """This process's defaults from a config's ``transport`` section: ``integrity``, ``row_digests``,
    ``tls`` and ``tls_records``."""
    set_default_integrity(bool(transport.get("integrity", True)))
    set_default_row_digests(bool(transport.get("row_digests", True)))
    set_default_tls(str(transport.get("tls", "") or ""))
    set_default_tls_records(str(transport.get("tls_records", "gearflow") or "gearflow"))


def default_integrity() -> bool:
    """``transport.integrity`` of this process (:func:`set_default_integrity`; else
    ``$GEARFLOW_INTEGRITY`` = 0/1 as the parent set it; else on)."""
    env = os.environ.get(INTEGRITY_ENV)
    if env is not None and env.strip().lower() in ("0", "false", "1", "true"):
        return env.strip().lower() in ("1", "true")
    return _integrity_default


def resolve_token(token: str | None = None) -> bytes:
    """The shared secret: ``token`` if given, else ``$GEARFLOW_TOKEN``; a missing or short one is a
    ``ValueError`` saying how to set it."""
    value = token if token else os.environ.get(TOKEN_ENV, "")
    if not value:
        raise ValueError(f"the transport needs a shared secret: set transport.token or ${TOKEN_ENV}")
    if len(value) < MIN_TOKEN_CHARS:
        raise ValueError(f"the transport secret must have at least {MIN_TOKEN_CHARS} characters")
    return value.encode() if isinstance(value, str) else bytes(value)


def _valid_name(name) -> bool:
    return (isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS
            and all(c.isascii() and (c.isalnum() or c in "-_") for c in name))  # fmt: skip


def actor_secret(learner_secret: bytes, name: str) -> bytes:
    return hmac.new(learner_secret, _ACTOR_LABEL + name.encode(), hashlib.sha256).digest()


def actor_credential(learner_secret: bytes | str, name: str = "actor") -> str:
    """The actor credential of ``name`` (letters, digits, ``-``, ``_``) derived from the learner's
    secret: what an actor machine holds instead of it (``gfa1.<name>.<64 hex>``)."""
    if isinstance(learner_secret, str):
        learner_secret = learner_secret.encode()
    if learner_secret.startswith(ACTOR_PREFIX.encode()):
        raise ValueError("an actor credential cannot derive another: give the learner's secret")
    if not _valid_name(name):
        raise ValueError(f"an actor name is 1-{MAX_NAME_CHARS} letters, digits, '-' or '_', got {name!r}")
    return f"{ACTOR_PREFIX}{name}.{actor_secret(learner_secret, name).hex()}"


class Credential:
    """What one end holds: the learner secret (``role`` learner) or an actor credential."""

    __slots__ = ("name", "role", "secret")

    def __init__(self, role: str, name: str, secret: bytes):
        self.role, self.name, self.secret = role, name, secret

    def __repr__(self) -> str:  # never the secret
        return f"Credential({self.role}{', ' + self.name if self.name else ''})"


def credential(secret: bytes) -> Credential:
    """The :class:`Credential` of a resolved token (:func:`resolve_token`)."""
    if secret.startswith(ACTOR_PREFIX.encode()):
        fields = secret.decode("ascii", "replace").split(".")
        name, key = (fields[1], fields[2]) if len(fields) == 3 else ("", "")
        if not _valid_name(name) or len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise ValueError("a malformed actor credential (expected gfa1.<name>.<64 hex>, from `gearflow secret actor`)")
        return Credential(ACTOR, name, bytes.fromhex(key))
    return Credential(LEARNER, "", secret)


def role_secret(learner_secret: bytes, role, name) -> bytes | None:
    """The secret a client of ``role`` / ``name`` must prove (the service's side); None: no such role."""
    if role == LEARNER and name == "":
        return learner_secret
    if role == ACTOR and _valid_name(name):
        return actor_secret(learner_secret, name)
    return None


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def transcript(server_nonce: str, client_nonce: str, role: str, name: str, integrity: bool,
               limits: list[int] | None = None) -> bytes:  # fmt: skip
    text = f"gearflow-auth-v{PROTOCOL}|{server_nonce}|{client_nonce}|{role}|{name}|{int(bool(integrity))}"
    if limits is not None:  # the client's frame limits, when it announces them
        text += "|limits:" + ":".join(str(int(n)) for n in limits)
    return text.encode()


def client_mac(secret: bytes, transcript_: bytes) -> str:
    return hmac.new(secret, b"client|" + transcript_, hashlib.sha256).hexdigest()


def server_mac(secret: bytes, transcript_: bytes) -> str:
    return hmac.new(secret, b"server|" + transcript_, hashlib.sha256).hexdigest()


def frame_keys(secret: bytes, transcript_: bytes, server_nonce: str, client_nonce: str) -> tuple[bytes, bytes]:
    """(client → server, server → client) frame keys of a connection (``integrity.session_keys``)."""
    from gearflow.transport.integrity import session_keys

    return session_keys(secret, transcript_, server_nonce, client_nonce)


def valid_nonce(n) -> bool:
    return isinstance(n, str) and len(n) == 2 * NONCE_BYTES and all(c in "0123456789abcdef" for c in n)


def check(expected: str, got) -> bool:
    return isinstance(got, str) and hmac.compare_digest(expected.encode(), got.encode())

"""Shared-secret authentication of a connection: a mutual HMAC challenge-response.

    server → client   CHALLENGE {"nonce": server nonce (32 random bytes, hex), "version": 1}
    client → server   AUTH      {"nonce": client nonce, "mac": HMAC(secret, "client" | sn | cn)}
    server → client   AUTH_OK   {"mac": HMAC(secret, "server" | sn | cn)}      (or ERROR, then close)

The server's nonce is fresh per connection, so a recorded AUTH (made for another server
nonce) is refused; the client's nonce makes the server's answer fresh too, so a recorded
AUTH_OK cannot convince a client that a peer without the secret is the service. Both sides
compare with ``hmac.compare_digest``. The secret comes from the config or ``GEARFLOW_TOKEN``
(:func:`resolve_token`); there is no unauthenticated mode.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from gearflow.errors import GearflowError

__all__ = ["NONCE_BYTES", "TOKEN_ENV", "AuthenticationError", "client_mac", "new_nonce", "resolve_token", "server_mac"]

TOKEN_ENV = "GEARFLOW_TOKEN"
NONCE_BYTES = 32
MIN_TOKEN_CHARS = 8


class AuthenticationError(GearflowError, PermissionError):
    """A peer did not prove it holds the shared secret (wrong token, replayed handshake, or a
    service that is not the one configured)."""


def resolve_token(token: str | None = None) -> bytes:
    """The shared secret: ``token`` if given, else ``$GEARFLOW_TOKEN``; a missing or short one is a
    ``ValueError`` saying how to set it."""
    value = token if token else os.environ.get(TOKEN_ENV, "")
    if not value:
        raise ValueError(f"the transport needs a shared secret: set transport.token or ${TOKEN_ENV}")
    if len(value) < MIN_TOKEN_CHARS:
        raise ValueError(f"the transport secret must have at least {MIN_TOKEN_CHARS} characters")
    return value.encode() if isinstance(value, str) else bytes(value)


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def _mac(secret: bytes, role: bytes, server_nonce: str, client_nonce: str) -> str:
    msg = b"gearflow-auth-v1|" + role + b"|" + server_nonce.encode() + b"|" + client_nonce.encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def client_mac(secret: bytes, server_nonce: str, client_nonce: str) -> str:
    return _mac(secret, b"client", server_nonce, client_nonce)


def server_mac(secret: bytes, server_nonce: str, client_nonce: str) -> str:
    return _mac(secret, b"server", server_nonce, client_nonce)


def valid_nonce(n) -> bool:
    return isinstance(n, str) and len(n) == 2 * NONCE_BYTES and all(c in "0123456789abcdef" for c in n)


def check(expected: str, got) -> bool:
    return isinstance(got, str) and hmac.compare_digest(expected.encode(), got.encode())

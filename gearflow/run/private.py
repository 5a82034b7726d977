"""Secrets stay secret: what a run writes holds no token, and only its owner can read it.

* :func:`redacted` — a copy of a config without its secret (``transport.token`` emptied):
  what goes into ``RUN_DIR/config.yaml``, every ``checkpoints/*/runner.json`` and the config a
  remote actor gets from ``run.join`` (it already holds its secret). A resumed run, ``gearflow
  eval`` and a joiner read the secret from ``$GEARFLOW_TOKEN`` or ``transport.token_file``.
* :func:`private_dir` — a directory made (or tightened to) 0700; :func:`private_umask` — the
  process's umask 0077, so files a run writes (logs, metrics, checkpoints) are 0600.
* :func:`config_token` — the secret a config names: ``transport.token``, else the contents of
  ``transport.token_file``, else None (then ``$GEARFLOW_TOKEN``:
  :func:`gearflow.transport.auth.resolve_token`).

    save_config(redacted(cfg), private_dir(run_dir) / "config.yaml")
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from gearflow.errors import ConfigError

__all__ = ["config_token", "private_dir", "private_umask", "redacted", "SECRET_KEYS"]

SECRET_KEYS = ("transport.token",)  # config keys that hold a secret (never written, never sent)


def redacted(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` with every secret key emptied (the config itself is left as it is)."""
    out = cfg.copy()
    with open_dict(out):
        for key in SECRET_KEYS:
            if OmegaConf.select(out, key) not in (None, ""):
                OmegaConf.update(out, key, "", merge=False)
    return out


def private_dir(path: str | Path) -> Path:
    """``path`` made with its parents if missing, its own mode 0700 (an existing one is tightened)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def private_umask() -> None:
    """Files and directories this process makes from now on: 0600 / 0700 (umask 0077)."""
    os.umask(0o077)


def config_token(transport) -> str | None:
    """The secret ``transport`` (a config's ``transport`` group) names, or None for ``$GEARFLOW_TOKEN``.
    A ``token_file`` readable by others than its owner is refused (it would not be a secret)."""
    if transport.get("token"):
        return str(transport.token)
    path = transport.get("token_file") or ""
    if not path:
        return None
    p = Path(os.path.expanduser(str(path)))
    try:
        mode = stat.S_IMODE(p.stat().st_mode)
        text = p.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"transport.token_file={str(path)!r}: cannot read it: {exc.strerror or exc}") from None
    if mode & 0o077:
        raise ConfigError(f"transport.token_file={str(path)!r} is readable by others (mode {mode:o}): chmod 600 it")
    if not text:
        raise ConfigError(f"transport.token_file={str(path)!r} is empty")
    return text

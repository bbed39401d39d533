"""The password of ``make up``'s embedded Redis, and the config file that hands it over.

The password is generated once (``secrets.token_urlsafe(32)``) into
``DATA_DIR/redis.password``, mode 0600, and reused on every later start; a data directory
from before it existed gets one on its next start (its AOF loads as before). Every fleet
process reads it there (``Settings.embedded_redis_url``). redis-server gets it from
``DATA_DIR/redis.conf`` (mode 0600 too), never on its command line, which every user of the
machine can read (``ps``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from shared.settings import Settings

CONFIG_FILE = "redis.conf"


class PasswordFileError(RuntimeError):
    """DATA_DIR's password file cannot be used as it is; the message says what to do."""


def prepare(settings: Settings) -> Path:
    """Make sure the password exists and write the config file that carries it; return the
    config file's path, for :func:`fleet.commands.redis_server`."""
    password = ensure_password(settings.embedded_redis_password_file)
    config = settings.data_dir.resolve() / CONFIG_FILE
    _write_private(config, f"requirepass {password}\n")
    return config


def ensure_password(path: Path) -> str:
    """The password kept in ``path``, generated there first if there is none."""
    if not path.exists():
        _write_private(path, secrets.token_urlsafe(32) + "\n")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise PasswordFileError(
            f"{path} holds the embedded Redis's password but other users may read it "
            f"(mode {mode:04o}): chmod 600 it"
        )
    password = path.read_text().strip()
    if not password:
        raise PasswordFileError(f"{path} is empty: delete it, and a new password is made")
    return password


def _write_private(path: Path, text: str) -> None:
    """Write ``path`` whole and readable by its owner only: created 0600 (never chmod-ed
    after writing), then renamed over any older file, so no reader sees it half written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    with contextlib.suppress(FileNotFoundError):
        partial.unlink()  # left by a start that died mid-write (DATA_DIR's lock is held)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)

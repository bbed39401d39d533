"""One fleet per DATA_DIR, for as long as any of its processes lives.

``make up`` takes an exclusive lock on ``DATA_DIR/fleet.lock`` and hands the locked file to
every process it starts. The kernel releases the lock only when the last of them exits, so
a new fleet cannot start on the same data directory (and, with it, the same embedded Redis
port and worker names) while a worker of an old one is still draining after its
supervisor was killed.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "fleet.lock"


class DataDirInUse(RuntimeError):
    pass


def hold(data_dir: Path) -> int:
    """The locked file's descriptor (pass it to every child); DataDirInUse if held."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise DataDirInUse(
            f"another fleet (started by pid {holder}), or a process left of one, still runs "
            f"on DATA_DIR {data_dir}; stop it, or use another DATA_DIR"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd

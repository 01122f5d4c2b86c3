"""One writer per run folder: an exclusive lock on `OUTPUT_DIR/.lock`, held for the run's life.

The lock is `fcntl.flock` on a file kept open by the run, so the kernel releases it however the process ends
(`kill -9` and an out-of-memory kill included): a lock left by a dead run is simply free, and the next run
takes it over without anyone deleting a file. The holder writes its pid into the file, so a second writer is
refused with one line naming it. Two runs writing one folder would otherwise interleave their `metrics.jsonl`
rows and leave `final/` and `config.yaml` from whichever finished last.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from tokenmill.types import TokenmillError

FILENAME = ".lock"


class RunFolderLocked(TokenmillError):
    """Another live process writes this run folder."""

    exit_code = 2  # like a bad config: the user picks another output folder or stops the other run


class RunLock:
    """The held lock of one run folder; `release()` (or the process's end) frees it."""

    def __init__(self, folder: Path, fd: int) -> None:
        self.folder, self._fd = folder, fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the descriptor drops the flock

    def __del__(self) -> None:  # a run dropped without close() (its build failed half-way) frees the folder
        self.release()


def lock_run_folder(folder: str | Path) -> RunLock:
    """Take the exclusive lock of `folder` (created if missing) or raise RunFolderLocked naming the holder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / FILENAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunFolderLocked(
            f"{folder} is in use by another run ({holder}); stop it first, or give this run another "
            "tracking.output_dir") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return RunLock(folder, fd)


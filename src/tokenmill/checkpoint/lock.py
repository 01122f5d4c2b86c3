"""One writer per run folder: an exclusive lock on `OUTPUT_DIR/.lock`, held for the run's life.

The lock is `fcntl.flock` on a file kept open by the run, so the kernel releases it however the process ends
(`kill -9` and an out-of-memory kill included): a lock left by a dead run is simply free, and the next run
takes it over without anyone deleting a file. The holder writes its pid into the file, so a second writer is
refused with one line naming it. Two runs writing one folder would otherwise interleave their `metrics.jsonl`
rows and leave `final/` and `config.yaml` from whichever finished last.

Within one process a lock is taken before a run is built and handed to it (`adopt`) once built. A build that
failed half-way leaves its lock unadopted (held by the failed call's traceback, which a notebook or a test keeps):
the next lock of that folder in the same process releases it rather than refusing the retry.
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import weakref
from pathlib import Path

from tokenmill.checkpoint.space import disk_error
from tokenmill.types import TokenmillError

FILENAME = ".lock"
_mine: weakref.WeakValueDictionary[Path, RunLock] = weakref.WeakValueDictionary()  # this process's, by folder
_mine_lock = threading.Lock()


class RunFolderLocked(TokenmillError):
    """Another live process writes this run folder."""

    exit_code = 2  # like a bad config: the user picks another output folder or stops the other run


class RunLock:
    """The held lock of one run folder; `release()` (or the process's end) frees it."""

    def __init__(self, folder: Path, fd: int) -> None:
        self.folder, self._fd = folder, fd
        self.adopted = False  # a built run holds it (else: its build failed, see the module's docstring)

    def adopt(self) -> RunLock:
        self.adopted = True
        return self

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the descriptor drops the flock

    def __del__(self) -> None:  # a lock dropped unreleased (a run never closed) frees the folder
        self.release()


def lock_run_folder(folder: str | Path) -> RunLock:
    """Take the exclusive lock of `folder` (created if missing) or raise RunFolderLocked naming the holder."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        key = folder.resolve()
        with _mine_lock:
            left = _mine.get(key)
            if left is not None and not left.adopted:  # an earlier build of this process failed before its run
                left.release()
            lock = _take(folder)
            _mine[key] = lock
    except OSError as exc:  # a read-only or full folder: one line before anything is loaded
        raise disk_error(exc, folder, "the run's lock file") or exc from None
    return lock


def _take(folder: Path) -> RunLock:
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


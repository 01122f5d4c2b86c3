"""Child processes that die with the process that started them, even when it is SIGKILLed.

A kill -9 runs no cleanup: `atexit`, `finally` and `Process(daemon=True)` do nothing, so a worker that
only waits for a message (or spins in user code) would live on forever. The kernel can do it instead:
`prctl(PR_SET_PDEATHSIG, SIGKILL)` in the child makes the kernel kill it when its parent goes. Two
caveats, both handled here: the signal is tied to the *thread* that forked the child (a worker forked
from a short-lived thread is killed early, and simply re-forked by its owner; a long-lived program
started from such a thread gets no signal and watches its parent instead: `parent_env`, `watch_parent`),
and a parent that died before the prctl ran is caught by comparing `getppid()` with the pid the parent
had. Where prctl does not exist (not Linux), a daemon thread in the child polls `getppid()` instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
POLL_S = 0.5
PARENT_ENV = "TOKENMILL_PARENT_PID"


def _load_prctl() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


# resolved once in the parent, so the child (possibly between fork and exec) only makes the call
_PRCTL = _load_prctl() if os.name == "posix" else None


def die_with_parent(parent_pid: int, *, death_signal: bool = True) -> None:
    """Call in a freshly forked child: get SIGKILLed when `parent_pid` (our parent) exits (`death_signal`
    False: a thread polls for it instead, as where prctl does not exist).

    Exits at once if the parent is already gone (it died between the fork and this call)."""
    if not death_signal or _PRCTL is None or _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        threading.Thread(target=_watch, args=(parent_pid,), name="die-with-parent", daemon=True).start()
    if os.getppid() != parent_pid:
        os._exit(1)


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    os._exit(1)


def preexec_die_with_parent() -> Callable[[], None]:
    """A `preexec_fn` for `subprocess.Popen`: the spawned program is killed when the caller exits (the
    death signal survives exec). Build it in the parent: it captures the parent's pid."""
    parent = os.getpid()
    # the signal follows the thread that forks: from any other thread it would kill the child when that thread
    # ends, so there the child watches for the parent itself (`parent_env` and `watch_parent`)
    on_main = threading.current_thread() is threading.main_thread()

    def preexec() -> None:
        if on_main and _PRCTL is not None:
            _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def parent_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a child that calls `watch_parent`: it names this process as the parent to watch."""
    return env | {PARENT_ENV: str(os.getpid())}


def watch_parent() -> None:
    """In a child started with `parent_env`: exit when the parent named there is gone (polled every `POLL_S`);
    the death signal of `preexec_die_with_parent` does it at once where it applies, this wherever it does not."""
    named = os.environ.pop(PARENT_ENV, "")
    if named.isdigit():  # no death signal here: it would follow whichever thread of the parent started us
        die_with_parent(int(named), death_signal=False)


# indices into `stat_fields`: /proc/<pid>/stat after "pid (comm)" is "state ppid pgrp ..."
STAT_PPID, STAT_PGRP = 1, 2


def stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after "pid (comm)" (the command may hold spaces and parentheses), or None
    when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()


def pids_where(field: int, value: int) -> list[int]:
    """The live processes whose stat field `field` (`STAT_PPID`, `STAT_PGRP`) is `value` (Linux; empty where
    there is no /proc)."""
    if not os.path.isdir("/proc"):
        return []
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = stat_fields(int(entry.name))
            if fields is not None and int(fields[field]) == value:
                found.append(int(entry.name))
    return found


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0, *, terminate: bool = True) -> None:
    """End `proc`: SIGTERM (unless `terminate` is False: it was already asked to exit), up to `timeout_s` for it
    to exit, then SIGKILL."""
    if terminate and proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)

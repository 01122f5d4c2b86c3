"""Call a user function with a hard timeout, so a reward that hangs or spins cannot stall a run.

`ProcessCaller` keeps one forked worker per function. The function object is inherited through `fork`
(never pickled, so closures and lambdas work); arguments and results cross a pipe. A call that runs past
its timeout gets the worker killed (and a fresh one forked on the next call): a busy loop really stops,
which a thread cannot promise. A worker dies with the process that forked it, even one killed with
SIGKILL: the kernel's parent-death signal (`tokenmill.sandbox.lifetime`), and the worker closes its
copy of the parent's end of the pipe, so it also sees end-of-file when the parent goes.
`ThreadCaller` is the fallback where fork is unavailable, or when the function itself needs
torch/OpenMP (unsafe after fork); a hung call there is abandoned, not killed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing as mp
import os
import signal
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenmill.sandbox.lifetime import die_with_parent
from tokenmill.types import TokenmillError


class CallTimeout(TokenmillError):
    """The function did not return within its time limit (a worker process is killed, a thread abandoned)."""


class CallFailed(TokenmillError):
    """The function raised; the message carries its exception type, text and last frame."""


_OURS = str(Path(__file__).resolve().parents[1])  # the tokenmill package
_LIBRARIES = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})


def _describe(exc: BaseException) -> str:
    """'Type: message at file:line', the line being the user's: the deepest frame outside tokenmill and
    installed libraries (a ValueError from json.loads points at the reward's call of it), else the deepest
    outside tokenmill, else the deepest."""
    frames = traceback.extract_tb(exc.__traceback__)
    theirs = [f for f in frames if not f.filename.startswith(_OURS)]
    own = [f for f in theirs if not f.filename.startswith(_LIBRARIES)]
    frame = (own or theirs or frames or [None])[-1]
    where = f" at {frame.filename}:{frame.lineno}" if frame is not None else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _serve(fn: Callable[..., Any], conn, parent_end, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    # Ctrl-C in a terminal reaches the whole process group: the trainer handles it and closes its workers,
    # so a worker ignores it instead of printing a KeyboardInterrupt traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent_end.close()  # else this worker holds both ends and never sees EOF when the parent dies
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    while True:
        try:
            args, kwargs = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - everything the user code raises is reported as data
            try:
                conn.send(("error", _describe(exc)))
            except Exception:  # noqa: BLE001 - e.g. an unpicklable result
                return


class ProcessCaller:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._proc: mp.process.BaseProcess | None = None
        self._conn = None

    def _start(self) -> None:
        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(self.fn, child, parent, os.getpid()), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent

    def __call__(self, *args: Any, timeout: float, **kwargs: Any) -> Any:
        if self._proc is None or not self._proc.is_alive():
            self._start()
        try:
            self._conn.send((args, kwargs))
        except Exception as exc:  # noqa: BLE001 - arguments that cannot be pickled
            raise CallFailed(f"could not send arguments: {_describe(exc)}") from None
        if not self._conn.poll(timeout):
            self.close()
            raise CallTimeout(f"no result within {timeout:g}s (worker killed)")
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.exitcode if self._proc else None
            self.close()
            raise CallFailed(f"worker died (exit code {code})") from None
        if status == "error":
            raise CallFailed(payload)
        return payload

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        with contextlib.suppress(Exception):
            self.close()


class ThreadCaller:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def __call__(self, *args: Any, timeout: float, **kwargs: Any) -> Any:
        future = self._pool.submit(self.fn, *args, **kwargs)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            # the thread cannot be killed: abandon it and give later calls a fresh worker
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
            raise CallTimeout(f"no result within {timeout:g}s (thread abandoned)") from None
        except Exception as exc:  # noqa: BLE001 - user code
            raise CallFailed(_describe(exc)) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def make_caller(fn: Callable[..., Any], isolation: str) -> ProcessCaller | ThreadCaller:
    if isolation == "process" and "fork" in mp.get_all_start_methods():
        return ProcessCaller(fn)
    return ThreadCaller(fn)

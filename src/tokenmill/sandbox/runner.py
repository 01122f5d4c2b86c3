"""Run model-written Python in a throwaway sandbox: a separate process tree that cannot outlive its limits.

Why namespaces and not just `subprocess.run(timeout=)`: a timeout kills one process, not its children, and a
child that calls `setsid()` leaves any process group we would kill. A child with an "empty" environment can
still read our secrets in `/proc/<our pid>/environ` and signal us (same uid). Only a PID namespace makes
"kill the sandbox" mean "kill everything in it": when its pid 1 dies, the kernel kills the rest. So:

* ``bwrap`` (bubblewrap): new user/pid/net/ipc/uts/mount namespaces, a root holding only read-only /usr,
  our own /proc and /dev, and size-capped tmpfs for /sandbox (the program's files), /tmp and /dev/shm.
* ``unshare`` (util-linux): the same namespaces; our bootstrap (`_boot.py`) builds the same root and drops
  every capability, where bubblewrap is not installed.
* ``none``: a plain process with the limits, an empty environment and a process-group kill. Only when asked
  for by name: it neither hides the network, /proc nor the filesystem, and `setsid()` escapes its kill.

Running as root, the kernel exempts uid 0 from RLIMIT_NPROC, and a user namespace made by root is still
uid 0 outside, so a fork bomb would be uncapped: the sandbox therefore always starts as `nobody` (65534).
Limits are set inside the sandbox's user namespace, so each sandbox has its own process budget.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from tokenmill.sandbox.lifetime import STAT_PPID, pids_where, stat_fields
from tokenmill.sandbox.limits import Limits, RunResult, SandboxUnavailable

log = logging.getLogger("tokenmill.sandbox")
DEFAULT_LIMITS = Limits()

ISOLATIONS = ("bwrap", "unshare", "none")
NAMESPACED = ("bwrap", "unshare")  # in order of preference for isolation="auto"
PYTHON = "/usr/bin/python3"  # the system interpreter: it lives under /usr, the one host tree we mount
NOBODY = 65534
MIB = 1 << 20
SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
EXIT_GRACE_S = 0.5  # how long to keep reading after the program exits, for output still in the pipes
TEARDOWN_S = 5.0  # how long to wait for a killed namespace to empty
BOOT_SOURCE = (Path(__file__).parent / "_boot.py").read_text()
FIX = (
    "Install bubblewrap (`apt-get install bubblewrap`, `dnf install bubblewrap`) and allow unprivileged user "
    "namespaces (sysctl user.max_user_namespaces > 0; kernel.unprivileged_userns_clone=1 on older Debian; "
    "kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu >= 23.10; in Docker, a seccomp profile that "
    "permits unshare/clone with namespace flags). Or pass isolation='none' to run the code unconfined "
    "(trusted code only)."
)


def _sandbox_uid() -> int | None:
    """The uid the sandbox starts as: `nobody` when we are root (see the module docstring), else ours."""
    return NOBODY if os.geteuid() == 0 else None


@functools.cache
def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin")


_BWRAP_HELP: dict[str, str] = {}


def _bwrap_supports(bwrap: str, option: str) -> bool:
    if bwrap not in _BWRAP_HELP:
        done = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10, env={}, check=False)
        _BWRAP_HELP[bwrap] = done.stdout + done.stderr
    return option in _BWRAP_HELP[bwrap]


def _missing(isolation: str) -> str | None:
    """Why `isolation` cannot even be tried here (a missing program), or None."""
    if not os.access(PYTHON, os.X_OK):
        return f"{PYTHON} not found: install python3; sandboxed code runs on the system interpreter"
    if isolation == "bwrap":
        bwrap = _tool("bwrap")
        if bwrap is None:
            return "bwrap not found: install bubblewrap"
        if not _bwrap_supports(bwrap, "--size"):
            return f"{bwrap} is too old (no --size): install bubblewrap >= 0.6"
    if isolation == "unshare" and _tool("unshare") is None:
        return "unshare not found: install util-linux"
    return None


# ---------------------------------------------------------------------------------- commands


def _rlimits(limits: Limits) -> dict[str, list[int]]:
    cpu = max(1, math.ceil(limits.cpu_seconds))
    return {
        "RLIMIT_CPU": [cpu, cpu + 1],  # SIGXCPU at the soft limit, SIGKILL a second later
        "RLIMIT_AS": [limits.memory_mb * MIB] * 2,
        "RLIMIT_FSIZE": [limits.file_size_mb * MIB] * 2,
        "RLIMIT_NPROC": [limits.process_cap()] * 2,  # max_processes, lowered to keep the memory total
        "RLIMIT_NOFILE": [limits.max_open_files] * 2,
    }


def _boot(mode: str, limits: Limits, home: str, tmp: str, parent: int | None = None) -> list[str]:
    """The bootstrap command line: it sets the limits (and builds the root in mode "init"), then runs
    main.py. `-E -s` rather than `-I`: the environment is ours and empty anyway, and `-I` would also drop the
    script's directory from sys.path, so the program could not import the other files it was given."""
    config = {
        "mode": mode,
        "argv": [PYTHON, "-E", "-s", "main.py"],
        "env": {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": tmp, "LANG": "C.UTF-8"},
        "rlimits": _rlimits(limits),
        "disk_bytes": limits.disk_mb * MIB,
        "parent": parent,
    }
    return [PYTHON, "-I", "-S", "-c", BOOT_SOURCE, json.dumps(config)]


def _system_dirs_bwrap() -> list[str]:
    args: list[str] = []
    for name in SYSTEM_DIRS:
        host = f"/{name}"
        if os.path.islink(host):
            args += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            args += ["--ro-bind", host, host]
    return args


def _bwrap_command(names: list[str], input_dir: str, limits: Limits, fds: list[int]) -> list[str]:
    bwrap = _tool("bwrap")
    assert bwrap is not None
    disk = str(limits.disk_mb * MIB)
    cmd = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--clearenv",
           "--as-pid-1"]
    if _bwrap_supports(bwrap, "--disable-userns"):
        cmd.append("--disable-userns")
    cmd += ["--ro-bind", "/usr", "/usr", *_system_dirs_bwrap(), "--proc", "/proc", "--dev", "/dev"]
    cmd += ["--size", disk, "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    cmd += ["--size", disk, "--tmpfs", "/tmp", "--size", disk, "--tmpfs", "/sandbox"]
    for parent in sorted({str(p) for name in names for p in PurePosixPath(name).parents if str(p) != "."}):
        cmd += ["--dir", f"/sandbox/{parent}"]
    for name in names:  # bubblewrap copies each file into the sandbox's tmpfs from a descriptor we pass
        fds.append(os.open(os.path.join(input_dir, name), os.O_RDONLY | os.O_CLOEXEC))
        cmd += ["--file", str(fds[-1]), f"/sandbox/{name}"]
    cmd += ["--remount-ro", "/", "--chdir", "/sandbox", "--"]
    return cmd + _boot("reap", limits, "/sandbox", "/tmp")


def _unshare_command(limits: Limits) -> list[str]:
    unshare, setpriv = _tool("unshare"), _tool("setpriv")
    assert unshare is not None
    # setpriv --pdeathsig: if we die, unshare dies, and --kill-child takes the namespace's pid 1 with it.
    prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
    cmd = [unshare, "--user", "--map-root-user", "--net", "--pid", "--ipc", "--uts", "--cgroup",
           "--kill-child", "--mount-proc", "--"]
    return prefix + cmd + _boot("init", limits, "/sandbox", "/tmp")


# ---------------------------------------------------------------------------------- files


def _check_names(files: Mapping[str, str]) -> None:
    for name in files:
        path = PurePosixPath(name)
        if not name or path.is_absolute() or any(part in ("", ".", "..") for part in name.split("/")):
            raise ValueError(f"file name {name!r} must be a relative path without '.' or '..' parts")
        if "\0" in name:
            raise ValueError(f"file name {name!r} contains a NUL byte")


def _write_files(directory: str, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = os.path.join(directory, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def _chown_tree(top: str, uid: int) -> None:
    os.chown(top, uid, uid)
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, uid, follow_symlinks=False)


def _remove_tree(top: str) -> None:
    """Delete the work dir even if the program (isolation "none", same uid) made parts of it unreadable."""
    try:
        shutil.rmtree(top)
        return
    except OSError:
        pass
    for dirpath, dirnames, _ in os.walk(top):
        for name in dirnames:
            try:
                os.chmod(os.path.join(dirpath, name), 0o700, follow_symlinks=False)
            except OSError:
                pass
    shutil.rmtree(top, ignore_errors=True)


# ---------------------------------------------------------------------------------- processes


def _parent_of(pid: int) -> int | None:
    fields = stat_fields(pid)
    return None if fields is None else int(fields[STAT_PPID])


def _children(pid: int) -> list[int]:
    return pids_where(STAT_PPID, pid)


def _has_exited(pid: int) -> bool:
    """Whether `pid` has exited, without reaping it: until we reap it, its process group id stays ours."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_exit(pid: int, timeout: float) -> bool:
    """Wait until our child `pid` exits, without reaping it."""
    end = time.monotonic() + timeout
    while not _has_exited(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def _kill_child(child: int, parent: int) -> None:
    """SIGKILL `child` if it is still `parent`'s child, immune to the pid being reused meanwhile."""
    try:
        pidfd = os.pidfd_open(child)
    except ProcessLookupError:
        return
    except OSError:  # Linux < 5.3; a reused pid would also have to be the child of `parent`
        if _parent_of(child) == parent:
            os.kill(child, signal.SIGKILL)
        return
    try:
        if _parent_of(child) == parent:  # checked after the open: the pidfd pins the process we checked
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        os.close(pidfd)


def _kill_sandbox(outer: int, namespaced: bool) -> None:
    """SIGKILL everything. With namespaces: kill each namespace's pid 1 (the child of bwrap/unshare) and let
    bwrap/unshare reap it. The kernel lets pid 1 finish exiting only once every other process in its
    namespace is gone, so when bwrap/unshare has exited the sandbox is empty, and nothing is orphaned to a
    host init that might never reap it. Killing bwrap/unshare first would give neither guarantee."""
    if namespaced:
        for child in _children(outer):
            _kill_child(child, outer)
        if not _wait_exit(outer, TEARDOWN_S):
            log.error("sandbox (pid %d) still running %.0fs after SIGKILL to its pid 1", outer, TEARDOWN_S)
    _kill_group(outer)


class _Capture:
    """Keeps the first `limit` bytes of a stream and drains the rest, so the program never blocks on us."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()

    def add(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        if room > 0:
            self.data += chunk[:room]

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def _supervise(argv: list[str], cwd: str, pass_fds: list[int], stdin_path: str, limits: Limits,
               isolation: str) -> RunResult:
    start = time.monotonic()
    deadline = start + limits.wall_seconds
    uid = _sandbox_uid()
    drop = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    with open(stdin_path, "rb") as stdin:
        proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                                cwd=cwd, pass_fds=pass_fds, start_new_session=True, **drop)
    out, err = _Capture(limits.max_output_bytes), _Capture(limits.max_output_bytes)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    try:
        pidfd: int | None = os.pidfd_open(proc.pid)
        sel.register(pidfd, selectors.EVENT_READ, None)
    except OSError:  # Linux < 5.3: poll instead
        pidfd = None
    exited_at: float | None = None
    timed_out = False
    try:
        while True:
            now = time.monotonic()
            if exited_at is None and _has_exited(proc.pid):
                exited_at = now
                _kill_group(proc.pid)  # stragglers that still hold our pipes ("none")
            streams = [key for key in sel.get_map().values() if key.data is not None]
            if exited_at is not None and (not streams or now > exited_at + EXIT_GRACE_S):
                break
            if now >= deadline:
                timed_out = exited_at is None
                break
            wait = deadline - now if pidfd is not None else min(deadline - now, 0.05)
            if exited_at is not None:
                wait = min(wait, exited_at + EXIT_GRACE_S - now)
            for key, _ in sel.select(max(wait, 0.0)):
                if key.data is None:
                    sel.unregister(key.fileobj)
                    continue
                chunk = os.read(key.fd, 65536)
                if chunk:
                    key.data.add(chunk)
                else:
                    sel.unregister(key.fileobj)
    finally:
        if exited_at is None:
            _kill_sandbox(proc.pid, namespaced=isolation in NAMESPACED)
        else:
            _kill_group(proc.pid)
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
        proc.stdout.close()
        proc.stderr.close()
        returncode = proc.wait()
    return RunResult(
        returncode=None if timed_out else (128 - returncode if returncode < 0 else returncode),
        stdout=out.text(),
        stderr=err.text(),
        timed_out=timed_out,
        isolation=isolation,
        wall_seconds=time.monotonic() - start,
    )


def execute(isolation: str, files: Mapping[str, str], *, stdin: str = "", limits: Limits = DEFAULT_LIMITS) -> RunResult:
    """Run `main.py` from `files` under `isolation`, in a fresh work dir that is deleted afterwards.

    No check that `isolation` works here: that is `Sandbox`'s job (and this is what its probe calls)."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"unknown isolation {isolation!r}; choose from {ISOLATIONS}")
    _check_names(files)
    workdir = tempfile.mkdtemp(prefix="tokenmill-sandbox-")
    fds: list[int] = []
    try:
        input_dir = os.path.join(workdir, "input")
        os.mkdir(input_dir)
        _write_files(input_dir, files)
        stdin_path = os.path.join(workdir, "stdin")
        with open(stdin_path, "w", encoding="utf-8") as f:
            f.write(stdin)
        if isolation == "bwrap":
            argv = _bwrap_command(list(files), input_dir, limits, fds)
            cwd = "/"
        elif isolation == "unshare":
            os.mkdir(os.path.join(workdir, "root"))  # the bootstrap mounts the new root here
            argv, cwd = _unshare_command(limits), workdir
        else:
            tmp = os.path.join(workdir, "tmp")
            os.mkdir(tmp)
            argv, cwd = _boot("exec", limits, input_dir, tmp, parent=os.getpid()), input_dir
        uid = _sandbox_uid()
        if uid is not None and isolation != "bwrap":  # these run on the host's files, as nobody
            _chown_tree(workdir, uid)
        return _supervise(argv, cwd, fds, stdin_path, limits, isolation)
    finally:
        for fd in fds:
            os.close(fd)
        _remove_tree(workdir)


# ---------------------------------------------------------------------------------- probing

PROBE_CODE = (
    "import os\n"
    "usr_read_only = bool(os.statvfs('/usr').f_flag & os.ST_RDONLY)\n"
    "print('ok' if os.getpid() <= 3 and usr_read_only else 'not isolated')\n"
)
_probe_lock = threading.Lock()
_probed: dict[str, str | None] = {}  # isolation -> why it failed, or None when it works
_logged: set[str] = set()


def _probe(isolation: str) -> str | None:
    missing = _missing(isolation)
    if missing:
        return missing
    try:
        result = execute(isolation, {"main.py": PROBE_CODE}, limits=Limits(wall_seconds=30.0))
    except OSError as exc:
        return f"could not start {isolation}: {exc}"
    if result.ok and result.stdout.strip() == "ok":
        return None
    detail = (result.stderr.strip() or result.stdout.strip()).splitlines()[-3:]
    return f"{isolation} did not run a test program (exit {result.returncode}): {' | '.join(detail)}"


def _probe_all() -> dict[str, str | None]:
    with _probe_lock:
        for isolation in NAMESPACED:
            if isolation not in _probed:
                _probed[isolation] = _probe(isolation)
        return dict(_probed)


def available_isolation() -> list[str]:
    """The namespaced isolations that work on this machine, best first. Probed once per process by running
    a small program through each, since a program on PATH proves nothing (user namespaces may be off)."""
    return [isolation for isolation, failure in _probe_all().items() if failure is None]


def _log_once(isolation: str) -> None:
    with _probe_lock:
        if isolation in _logged:
            return
        _logged.add(isolation)
    who = "nobody (65534)" if _sandbox_uid() is not None else f"uid {os.getuid()}"
    if isolation == "none":
        log.warning("sandbox isolation: none; model code runs as %s with limits but no namespaces: it can "
                    "use the network, read /proc and write wherever %s may", who, who)
    else:
        log.info("sandbox isolation: %s (as %s; user/pid/net/mount namespaces, read-only /usr, limits)",
                 isolation, who)


class Sandbox:
    """Runs model-written Python under `limits`, one fresh sandbox per call; safe to share across threads.

    `isolation="auto"` picks the best that works ("bwrap", then "unshare") and raises SandboxUnavailable if
    neither does: it never falls back to "none", which must be asked for by name.
    """

    def __init__(self, isolation: str = "auto", limits: Limits = DEFAULT_LIMITS) -> None:
        if isolation != "auto" and isolation not in ISOLATIONS:
            raise ValueError(f"unknown isolation {isolation!r}; choose 'auto' or one of {ISOLATIONS}")
        self.limits = limits
        if isolation == "none":
            if not os.access(PYTHON, os.X_OK):
                raise SandboxUnavailable(f"{PYTHON} not found: install python3")
            self.isolation = "none"
        else:
            probed = _probe_all()
            wanted = NAMESPACED if isolation == "auto" else (isolation,)
            working = [name for name in wanted if probed[name] is None]
            if not working:
                reasons = "\n".join(f"  {name}: {probed[name]}" for name in wanted)
                raise SandboxUnavailable(f"no working sandbox for isolation={isolation!r}:\n{reasons}\n{FIX}")
            self.isolation = working[0]
        _log_once(self.isolation)

    def run_python(self, code: str, *, stdin: str = "", files: dict[str, str] | None = None,
                   limits: Limits | None = None) -> RunResult:
        """Write `code` to main.py (and `files` beside it), run it with `stdin`, and return its output."""
        files = dict(files or {})
        if "main.py" in files:
            raise ValueError("files must not contain 'main.py': that name holds `code`")
        return execute(self.isolation, {"main.py": code, **files}, stdin=stdin, limits=limits or self.limits)

    def __repr__(self) -> str:
        return f"Sandbox(isolation={self.isolation!r}, limits={self.limits!r})"

"""The first Python code that runs inside a sandbox, before the model's program (stdlib only).

The host never imports this for its behaviour: it passes the source to ``/usr/bin/python3 -I -S -c`` with a
JSON config in ``argv[1]``. It is Python rather than ``prlimit``/``mount`` binaries because the system
interpreter that runs the model's code is the one thing every isolation already depends on.

Resource limits are set here, *inside* the sandbox, on purpose: since Linux 5.14 RLIMIT_NPROC is counted per
user namespace, so a limit set after the namespace exists caps this sandbox's processes alone; set before,
it would count every process of the uid (the caller's, and other sandboxes running in parallel).

Two modes:

* ``exec``: set limits and exec the program (isolation "none").
* ``reap``: we are pid 1 of bubblewrap's namespaces (``--as-pid-1``): fork the program, reap until it exits.
  Not bubblewrap's own reaper, because bwrap exits as soon as its reaper reports the program's status,
  without waiting for the reaper (so for the namespace) to be gone: the caller could not know when the
  sandbox is empty, and the reaper is orphaned to a host init that may never reap it.
* ``init``: we are pid 1 of fresh user, pid, net, ipc, uts and mount namespaces made by ``unshare``, as root
  of that user namespace (an unprivileged uid outside). Build a minimal root like bubblewrap's (read-only
  /usr, size-capped tmpfs for /sandbox, /tmp and /dev/shm, a few device nodes, our own /proc), pivot into
  it, drop every capability for good, then fork the program and reap until it exits. When pid 1 exits the
  kernel kills whatever else is left in the namespace.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys

SETUP_FAILED = 125  # exit status when the sandbox could not be built; stderr then says why

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 1, 24, 28, 38, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
# noroot + locked, keep_caps locked, no_cap_ambient_raise + locked: exec never grants capabilities again.
SECUREBITS = 0b1 | 0b10 | 0b100000 | 0b1000000 | 0b10000000
PIVOT_ROOT_SYSCALL = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")  # merged-/usr symlinks, or real dirs
DEVICES = ("null", "zero", "full", "random", "urandom")


class SetupError(Exception):
    pass


def _libc():
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        ctypes, _ = _libc()
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    ctypes, libc = _libc()
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]

    def enc(value: str | None) -> bytes | None:
        return None if value is None else value.encode()

    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {source} on {target}")


def _bind_read_only(source: str, target: str) -> None:
    """Bind, then remount read-only, keeping the flags the kernel locks (nosuid, nodev, noexec, atime)."""
    _mount(source, target, None, MS_BIND | MS_REC)
    have = os.statvfs(target).f_flag
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY
    for st_flag, ms_flag in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                             (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
                             (os.ST_RELATIME, MS_RELATIME)):
        if have & st_flag:
            flags |= ms_flag
    if not have & (os.ST_NOATIME | os.ST_RELATIME):
        flags |= MS_STRICTATIME
    _mount(None, target, None, flags)


def _tmpfs(target: str, size: int, mode: str) -> None:
    _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode},size={size}")


def _build_root(disk_bytes: int) -> None:
    """Make and enter a root holding only what Python needs; the caller's cwd has `input/` and `root/`."""
    root = os.path.abspath("root")
    _tmpfs(root, 1 << 20, "0755")
    for name in ("usr", "proc", "dev", "tmp", "sandbox"):
        os.mkdir(f"{root}/{name}")
    _bind_read_only("/usr", f"{root}/usr")
    for name in SYSTEM_DIRS:
        host = f"/{name}"
        if os.path.islink(host):
            os.symlink(os.readlink(host), f"{root}/{name}")
        elif os.path.isdir(host):
            os.mkdir(f"{root}/{name}")
            _bind_read_only(host, f"{root}/{name}")
    _mount("/proc", f"{root}/proc", None, MS_BIND | MS_REC)  # unshare --mount-proc: this pid namespace only
    dev = f"{root}/dev"
    _tmpfs(dev, 1 << 16, "0755")
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            open(f"{dev}/{name}", "w").close()
            _mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(f"{dev}/shm")
    _tmpfs(f"{dev}/shm", disk_bytes, "1777")
    _mount(None, dev, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _tmpfs(f"{root}/tmp", disk_bytes, "1777")
    _tmpfs(f"{root}/sandbox", disk_bytes, "0755")
    shutil.copytree("input", f"{root}/sandbox", dirs_exist_ok=True)

    _, libc = _libc()
    machine = os.uname().machine
    if machine not in PIVOT_ROOT_SYSCALL:
        raise SetupError(f"pivot_root: unknown syscall number on {machine}")
    os.chdir(root)
    _check(libc.syscall(PIVOT_ROOT_SYSCALL[machine], b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "umount old root")  # the old root is stacked on "."
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir("/sandbox")


def _drop_privileges() -> None:
    """Leave the user namespace's root with no capabilities, now and after any exec."""
    try:  # no nested user namespaces (their root could mount things and widen the kernel surface)
        with open("/proc/sys/user/max_user_namespaces", "w") as f:
            f.write("0")
    except OSError:
        pass
    ctypes, libc = _libc()
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(libc.prctl(PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0), "securebits")
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    for cap in range(last_cap + 1):
        _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop bounding capability")
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable (x2): all zero
    _check(libc.capset(header, data), "capset")


def _set_limits(rlimits: dict[str, list[int]]) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for name, (soft, hard) in rlimits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _exec(config: dict) -> None:
    _set_limits(config["rlimits"])
    os.execve(config["argv"][0], config["argv"], config["env"])


def _init(config: dict) -> int:
    """Fork the program and reap; when we return, the kernel kills whatever is left in the namespace."""
    if config["mode"] == "init":
        _build_root(config["disk_bytes"])
        _drop_privileges()
    sys.stdout.flush()
    child = os.fork()
    if child == 0:
        try:
            _exec(config)
        except BaseException as exc:  # noqa: BLE001 - the forked child must never return into our loop
            sys.stderr.write(f"tokenmill sandbox: cannot start the program: {exc}\n")
            sys.stderr.flush()
        os._exit(127)
    while True:  # pid 1 reaps every orphan; it returns when the program itself ends
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return SETUP_FAILED
        if pid == child:
            return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def main() -> None:
    config = json.loads(sys.argv[1])
    try:
        if config.get("parent"):  # isolation "none": die with the caller: nothing else would kill us if it crashed
            _, libc = _libc()
            _check(libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "pdeathsig")
            if os.getppid() != config["parent"]:
                raise SetupError("the caller exited before the program started")
        if config["mode"] in ("init", "reap"):
            os._exit(_init(config))
        _exec(config)
    except (SetupError, OSError, ValueError) as exc:
        sys.stderr.write(f"tokenmill sandbox setup failed: {exc}\n")
        sys.stderr.flush()
        os._exit(SETUP_FAILED)


if __name__ == "__main__":
    main()

"""The sandbox for model-written code: every escape we know of, tried under each isolation that works here.

Each hostile program reports what it managed from inside; the test also checks from outside (the file is not
there, the listener got no connection, no process of the sandbox's uid is left). Limits are small so the
whole file stays fast on a shared two-core machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tokenmill.sandbox import Limits, RunResult, Sandbox, SandboxUnavailable, available_isolation, runner

HERE = available_isolation()
ISOLATION = pytest.mark.parametrize(
    "isolation",
    HERE or [pytest.param(None, marks=pytest.mark.skip(
        reason="no sandbox isolation works here (install bubblewrap, allow unprivileged user namespaces)"))],
)
SANDBOX_UID = 65534 if os.geteuid() == 0 else os.getuid()
SLACK_S = 3.0  # scheduling slack on a loaded machine
FAST = Limits(cpu_seconds=2, wall_seconds=5, memory_mb=256, max_processes=16, max_output_bytes=4096)


def run(isolation: str, code: str, limits: Limits = FAST, **kwargs) -> RunResult:
    return Sandbox(isolation, limits).run_python(textwrap.dedent(code), **kwargs)


def sandbox_processes() -> set[int]:
    """Processes that could belong to a sandbox: as root, any `nobody`; otherwise ours in another pid
    namespace."""
    own_ns = os.readlink("/proc/self/ns/pid")
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
            if uid != SANDBOX_UID:
                continue
            if SANDBOX_UID == os.getuid() and os.readlink(f"/proc/{entry.name}/ns/pid") == own_ns:
                continue
        except (OSError, StopIteration):
            continue  # exited meanwhile
        found.add(int(entry.name))
    return found


@pytest.fixture
def no_strays():
    """Fails the test if any sandbox process outlives `run_python`."""
    before = sandbox_processes()
    yield
    left = sandbox_processes() - before
    assert not left, f"sandbox processes survived: {sorted(left)}"


@pytest.fixture
def neighbour():
    """A process of the sandbox's uid outside the sandbox, holding a secret in its environment: the most a
    sandboxed program could hope to read or kill."""
    secret = f"hunter2-{os.getpid()}-{time.time_ns()}"
    drop = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    proc = subprocess.Popen(["sleep", "60"], env={"TOKENMILL_TEST_SECRET": secret, "PATH": "/usr/bin:/bin"},
                            **drop)
    yield proc, secret
    proc.kill()
    proc.wait()


# ---------------------------------------------------------------------------------- ordinary programs


@ISOLATION
def test_runs_code_and_returns_output(isolation, no_strays):
    result = run(isolation, "import sys\nprint('hello')\nprint('warn', file=sys.stderr)")
    assert result.ok and result.returncode == 0 and not result.timed_out
    assert (result.stdout, result.stderr) == ("hello\n", "warn\n")
    assert result.isolation == isolation and 0 < result.wall_seconds < 5


@ISOLATION
def test_stdin_files_and_imports(isolation):
    code = """
        import helper
        print(helper.shout(input()), open("data/words.txt").read().split())
    """
    files = {"helper.py": "def shout(s):\n    return s.upper()\n", "data/words.txt": "a b c"}
    result = run(isolation, code, stdin="quiet\nignored\n", files=files)
    assert result.ok, result.stderr
    assert result.stdout == "QUIET ['a', 'b', 'c']\n"


@ISOLATION
def test_failures_are_results(isolation):
    result = run(isolation, "import sys\nprint('partial', flush=True)\nsys.exit(3)")
    assert (result.returncode, result.ok, result.stdout) == (3, False, "partial\n")
    result = run(isolation, "1 / 0")
    assert result.returncode == 1 and "ZeroDivisionError" in result.stderr


@ISOLATION
def test_output_is_truncated_not_blocking(isolation):
    result = run(isolation, "import sys\nsys.stdout.write('x' * 1_000_000)\nprint('done', file=sys.stderr)")
    assert result.ok and result.stdout == "x" * FAST.max_output_bytes and result.stderr == "done\n"


@ISOLATION
def test_sees_only_itself(isolation):
    code = """
        import json, os
        print(json.dumps({
            "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
            "caps": [line.split()[1] for line in open("/proc/self/status") if line.startswith("Cap")],
            "root": sorted(os.listdir("/")),
            "cwd": os.getcwd(),
        }))
    """
    result = run(isolation, code)
    assert result.ok, result.stderr
    seen = json.loads(result.stdout)
    assert max(seen["pids"]) <= 3  # its own pid namespace: a reaper and the program, nothing of the host
    assert set(seen["caps"]) == {"0000000000000000"}  # no capabilities, not even inside its namespace
    assert {"home", "etc", "root", "work"}.isdisjoint(seen["root"]) and seen["cwd"] == "/sandbox"


@ISOLATION
def test_threads_run_side_by_side(isolation, no_strays):
    sandbox = Sandbox(isolation, FAST)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: sandbox.run_python(f"import time\ntime.sleep(0.2)\nprint({i})"),
                                range(6)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]
    assert all(r.ok for r in results)


# ---------------------------------------------------------------------------------- hostile programs


@ISOLATION
def test_infinite_loop_hits_cpu_limit(isolation, no_strays):
    limits = Limits(cpu_seconds=1, wall_seconds=8, max_processes=16)
    result = run(isolation, "while True:\n    pass", limits)
    assert not result.ok
    assert result.returncode == 128 + signal.SIGXCPU or result.timed_out
    assert result.wall_seconds < 1 + SLACK_S


@ISOLATION
def test_sleeper_hits_wall_clock(isolation, no_strays):
    result = run(isolation, "import time\nwhile True:\n    time.sleep(1)", Limits(wall_seconds=1))
    assert result.timed_out and result.returncode is None and not result.ok
    assert 1 <= result.wall_seconds < 1 + SLACK_S


@ISOLATION
def test_process_cap_and_orphans_are_killed(isolation, no_strays):
    code = """
        import os, time
        started = 0
        for _ in range(200):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                os.setsid()  # leave the process group: only the pid namespace still holds it
                time.sleep(60)
                os._exit(0)
            started += 1
        print(started)
    """
    result = run(isolation, code, Limits(max_processes=16, wall_seconds=5))
    assert result.ok, result.stderr
    assert 0 < int(result.stdout) < 16  # capped; the sleeping children die with the sandbox
    assert result.wall_seconds < 2 + SLACK_S  # returned when main.py ended, not when the children would


@ISOLATION
def test_fork_bomb_is_contained(isolation, no_strays):
    code = """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """
    result = run(isolation, code, Limits(cpu_seconds=2, wall_seconds=2, max_processes=16))
    assert not result.ok and result.wall_seconds < 2 + SLACK_S
    start = time.monotonic()
    after = run(isolation, "print('still here')")
    assert after.stdout == "still here\n" and time.monotonic() - start < 3


@ISOLATION
def test_memory_hog_fails(isolation):
    code = """
        try:
            big = bytearray(2 * 1024 ** 3)
            print("allocated 2 GiB")
        except MemoryError:
            print("MemoryError")
        chunks = []
        try:
            while True:
                chunks.append(bytearray(16 * 1024 ** 2))
        except MemoryError:
            print(len(chunks) * 16)
    """
    result = run(isolation, code, Limits(memory_mb=256))
    assert result.ok, result.stderr
    first, total = result.stdout.split()
    assert first == "MemoryError" and int(total) < 256


@ISOLATION
def test_processes_together_stay_within_the_total(isolation, no_strays):
    """Each process fills its address space; all of them at once stay under total_memory_mb (per-process
    caps alone allowed max_processes x memory_mb)."""
    code = """
        import os
        def fill():
            chunks = []
            try:
                while True:
                    chunks.append(bytearray(4 * 1024 ** 2))  # zero-filled: really resident
            except MemoryError:
                return chunks
        read, write = os.pipe()
        children = 0
        for _ in range(30):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                held = fill()
                os.write(write, b"%d\\n" % (4 * len(held)))
                os.read(read, 1)  # hold it until the parent is done (it never writes: killed at the end)
                os._exit(0)
            children += 1
        held = fill()
        reports = b""
        while reports.count(b"\\n") < children:
            reports += os.read(read, 4096)
        print(children + 1, 4 * len(held) + sum(int(x) for x in reports.split()))
    """
    limits = Limits(memory_mb=64, disk_mb=8, total_memory_mb=160, max_processes=32, wall_seconds=15,
                    cpu_seconds=10)
    assert limits.program_processes() == 2 and limits.worst_case_mb() == 152  # (160 - 3 x 8) // 64 = 2
    result = run(isolation, code, limits)
    assert result.ok, result.stderr
    processes, allocated_mb = map(int, result.stdout.split())
    assert processes == 2
    # each filled what Python's own ~30 MB left of its 64 MB; together never more than the total
    assert 2 * 16 < allocated_mb <= 2 * 64 < limits.total_memory_mb


def test_limits_keep_the_total():
    assert Limits().process_cap() == 5 and Limits().worst_case_mb() == 1728  # 3 x 512 + 3 x 64 <= 2048
    assert Limits(memory_mb=16).process_cap() == 64  # small processes: max_processes is the tighter cap
    with pytest.raises(ValueError, match=r"Limits.total_memory_mb \(100\) leaves no room .* at least 256"):
        Limits(memory_mb=64, total_memory_mb=100)


@ISOLATION
def test_huge_file_write_stops_at_limit(isolation):
    code = """
        import os
        for path in ("big.bin", "/tmp/big.bin"):
            try:
                with open(path, "wb") as f:
                    for _ in range(64):
                        f.write(b"x" * 1024 ** 2)
                        f.flush()
            except OSError as exc:
                print(exc.errno, os.path.getsize(path))
        written = 0
        try:  # many files, each under the size limit, still stop at the disk limit
            for i in range(64):
                with open(f"/tmp/part{i}", "wb") as f:
                    f.write(b"x" * 1024 ** 2)
                written += 1
        except OSError as exc:
            print(exc.errno, written)
    """
    result = run(isolation, code, Limits(file_size_mb=4, disk_mb=8, memory_mb=256))
    assert result.ok, result.stderr
    efbig, enospc = 27, 28
    assert result.stdout.split("\n")[:2] == [f"{efbig} {4 * 1024 ** 2}"] * 2
    errno, written = map(int, result.stdout.split("\n")[2].split())
    assert errno == enospc and written < 8


@ISOLATION
def test_network_is_unreachable(isolation):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        code = f"""
            import socket
            for address in [("127.0.0.1", {port}), ("1.1.1.1", 53)]:
                try:
                    socket.create_connection(address, timeout=2).close()
                    print("connected", address)
                except OSError as exc:
                    print("blocked", exc.errno)
        """
        result = run(isolation, code)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached the listener
    assert result.ok, result.stderr
    assert "connected" not in result.stdout and result.stdout.count("blocked") == 2


@ISOLATION
def test_environment_secrets_are_invisible(isolation, neighbour, monkeypatch):
    proc, secret = neighbour
    monkeypatch.setenv("TOKENMILL_TEST_SECRET", secret)
    code = f"""
        import glob, os
        seen = [f"environ={{k}}" for k, v in os.environ.items() if "hunter2" in v or "SECRET" in k]
        for path in glob.glob("/proc/*/environ") + ["/proc/{os.getpid()}/environ", "/proc/{proc.pid}/environ",
                                                     f"/proc/{{os.getppid()}}/environ"]:
            try:
                if b"hunter2" in open(path, "rb").read():
                    seen.append(path)
            except OSError:
                pass
        print("seen", seen)
    """
    result = run(isolation, code)
    assert result.ok, result.stderr
    assert result.stdout == "seen []\n" and secret not in result.stdout


@ISOLATION
def test_cannot_write_outside(isolation):
    outside = tempfile.mkdtemp(prefix="tokenmill-outside-")
    os.chmod(outside, 0o777)  # writable by anyone: only the sandbox's own filesystem view stops it
    targets = [f"{outside}/pwned", "/usr/pwned", "/usr/lib/pwned", "/pwned", "/dev/pwned"]
    code = f"""
        for path in {targets!r}:
            try:
                open(path, "w").write("pwned")
                print("wrote", path)
            except OSError as exc:
                print("blocked", exc.errno)
        open("/dev/null", "w").write("fine")
    """
    try:
        result = run(isolation, code)
        assert result.ok, result.stderr
        assert "wrote" not in result.stdout and result.stdout.count("blocked") == len(targets)
        assert os.listdir(outside) == [] and not os.path.exists("/usr/pwned") and not os.path.exists("/pwned")
    finally:
        os.rmdir(outside)


@ISOLATION
def test_cannot_kill_parent_or_neighbours(isolation, neighbour, no_strays):
    proc, _ = neighbour
    code = f"""
        import os, signal
        for pid in ({os.getpid()}, {proc.pid}, os.getppid(), -1):
            try:
                os.kill(pid, signal.SIGKILL)
                print("sent", pid)
            except OSError as exc:
                print("refused", pid, type(exc).__name__)
        print("alive")
    """
    result = run(isolation, code)
    assert result.ok, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"refused {os.getpid()} ProcessLookupError"  # we do not exist in its pid namespace
    assert lines[1] == f"refused {proc.pid} ProcessLookupError"
    # os.getppid() is the sandbox's own pid 1, which ignores signals from inside; -1 reaches only the sandbox
    assert lines[-1] == "alive" and proc.poll() is None


# ---------------------------------------------------------------------------------- choosing isolation


def test_none_only_when_asked(monkeypatch):
    sandbox = Sandbox("none", FAST)
    result = sandbox.run_python("print(6 * 7)")
    assert sandbox.isolation == result.isolation == "none" and result.stdout == "42\n"
    monkeypatch.setattr(runner, "_probed", {"bwrap": "bwrap not found: install bubblewrap", "unshare": "nope"})
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        Sandbox()  # never a silent fall back to "none"
    with pytest.raises(SandboxUnavailable, match="isolation='unshare'"):
        Sandbox("unshare")


@pytest.mark.skipif(not HERE, reason="no sandbox isolation works here")
def test_auto_picks_the_best_working():
    assert Sandbox().isolation == HERE[0] != "none"


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown isolation"):
        Sandbox("docker")
    with pytest.raises(ValueError, match="positive"):
        Limits(memory_mb=0)
    sandbox = Sandbox("none", FAST)
    with pytest.raises(ValueError, match="relative"):
        sandbox.run_python("pass", files={"../escape.py": ""})
    with pytest.raises(ValueError, match="main.py"):
        sandbox.run_python("pass", files={"main.py": ""})


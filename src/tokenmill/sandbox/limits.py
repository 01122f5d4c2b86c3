"""What a sandboxed run may use, what it returned, and the error raised when no sandbox can be built."""

from __future__ import annotations

from dataclasses import dataclass, fields

from tokenmill.types import TokenmillError

OWN_PROCESSES = 2  # the sandbox's pid 1 and bwrap/unshare, counted by RLIMIT_NPROC beside the program
TMPFS_COUNT = 3  # /sandbox, /tmp, /dev/shm, each up to disk_mb


@dataclass(frozen=True)
class Limits:
    """Per-run caps. Every one is enforced by the kernel, none by trusting the program.

    `cpu_seconds` is per process (RLIMIT_CPU, rounded up to whole seconds): a program that spreads work over
    many processes is stopped by `wall_seconds` instead, which always kills the whole sandbox.
    `memory_mb` is address space per process (RLIMIT_AS), so allocations fail with MemoryError rather than
    the machine swapping. `max_processes` counts the threads and processes of this sandbox only, its own
    pid 1 (and `unshare`) included. `disk_mb` is the size of each writable tmpfs in the sandbox (/sandbox,
    /tmp, /dev/shm); tmpfs lives in RAM, so this bounds memory as well as disk.

    `total_memory_mb` caps the sandbox as a whole: its tmpfs (3 x `disk_mb`) plus every process's address
    space. The kernel enforces it as a product of the limits above: the process cap actually applied is
    lowered to `process_cap()`, so that (processes the program may run) x `memory_mb` + 3 x `disk_mb` stays
    within the total. Threads count as processes for RLIMIT_NPROC, so a program with many threads needs a
    lower `memory_mb` (or a higher total). Without this, 64 processes x 512 MB would allow 32 GB.
    """

    cpu_seconds: float = 5.0
    wall_seconds: float = 10.0
    memory_mb: int = 512
    file_size_mb: int = 16
    max_processes: int = 64
    max_open_files: int = 256
    max_output_bytes: int = 65536  # stdout/stderr each truncated to this
    disk_mb: int = 64
    total_memory_mb: int = 2048

    def __post_init__(self) -> None:
        for field in fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"Limits.{field.name} must be positive, got {getattr(self, field.name)!r}")
        if self.max_processes < 4:
            raise ValueError("Limits.max_processes below 4 leaves no room beside the sandbox's own processes")
        if self.max_open_files < 16:
            raise ValueError("Limits.max_open_files below 16 leaves Python unable to start")
        if self.program_processes() < 1:
            raise ValueError(
                f"Limits.total_memory_mb ({self.total_memory_mb}) leaves no room for one process of "
                f"memory_mb ({self.memory_mb}) beside 3 tmpfs of disk_mb ({self.disk_mb}): raise "
                f"total_memory_mb to at least {self.memory_mb + TMPFS_COUNT * self.disk_mb} or lower the others"
            )

    def program_processes(self) -> int:
        """How many processes (threads included) the program itself may run: bounded by the process cap
        and by what the total memory leaves after the tmpfs, at `memory_mb` each."""
        room = (self.total_memory_mb - TMPFS_COUNT * self.disk_mb) // self.memory_mb
        return min(self.max_processes - OWN_PROCESSES, room)

    def process_cap(self) -> int:
        """RLIMIT_NPROC as set inside the sandbox (its own processes included)."""
        return OWN_PROCESSES + self.program_processes()

    def worst_case_mb(self) -> int:
        """The most memory the sandbox can pin, all limits reached at once: never above total_memory_mb."""
        return self.program_processes() * self.memory_mb + TMPFS_COUNT * self.disk_mb


@dataclass(frozen=True)
class RunResult:
    """How a sandboxed program ended.

    `returncode` follows the shell convention on every isolation: 128+N when signal N killed the program
    (e.g. 152 for SIGXCPU at the CPU limit, 137 for SIGKILL), None only when we killed it at `wall_seconds`.
    """

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool  # the wall-clock limit hit and everything in the sandbox was killed
    isolation: str  # "bwrap" | "unshare" | "none"
    wall_seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class SandboxUnavailable(TokenmillError):
    """The isolation asked for cannot be set up here; the message says what to install or change."""

"""What a sandboxed run may use, what it returned, and the error raised when no sandbox can be built."""

from __future__ import annotations

from dataclasses import dataclass, fields

from tokenmill.types import TokenmillError


@dataclass(frozen=True)
class Limits:
    """Per-run caps. Every one is enforced by the kernel, none by trusting the program.

    `cpu_seconds` is per process (RLIMIT_CPU, rounded up to whole seconds): a program that spreads work over
    many processes is stopped by `wall_seconds` instead, which always kills the whole sandbox.
    `memory_mb` is address space per process (RLIMIT_AS), so allocations fail with MemoryError rather than
    the machine swapping; a program may hold up to `max_processes` times that in all. `max_processes` counts
    the threads and processes of this sandbox only, its own pid 1 (and `unshare`) included. `disk_mb` is the size of each writable tmpfs
    in the sandbox (/sandbox, /tmp, /dev/shm); tmpfs lives in RAM, so this bounds memory as well as disk.
    """

    cpu_seconds: float = 5.0
    wall_seconds: float = 10.0
    memory_mb: int = 512
    file_size_mb: int = 16
    max_processes: int = 64
    max_open_files: int = 256
    max_output_bytes: int = 65536  # stdout/stderr each truncated to this
    disk_mb: int = 64

    def __post_init__(self) -> None:
        for field in fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"Limits.{field.name} must be positive, got {getattr(self, field.name)!r}")
        if self.max_processes < 4:
            raise ValueError("Limits.max_processes below 4 leaves no room beside the sandbox's own processes")
        if self.max_open_files < 16:
            raise ValueError("Limits.max_open_files below 16 leaves Python unable to start")


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

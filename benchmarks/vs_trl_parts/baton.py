"""Interleaved runs (`vs_trl.py --interleave N`): both trainers start together and take turns by blocks of N
training steps, so that each block of one meets the machine as the neighbouring blocks of the other do.

On a shared machine the speed drifts by 20-50% over a minute; run one after the other, the two trainers meet
different machines and their ratio moves with the drift. Taking turns, both sample the same stretch of time.
A trainer waits for its turn between steps, before its step timer starts, so the waits are never timed; its
setup, held-out evaluations and final evaluation run outside the timed steps as before (the setup of both at
once, before the first turn).

The parent holds one pipe pair per child: it writes `g` (go) to the child whose turn it is; the child writes
`y` (yield) after N steps, or `d` (done) when it has finished everything. The child's ends arrive as file
descriptors in `VS_TRL_BATON` ("read,write").
"""

from __future__ import annotations

import os
import select
import subprocess

ENV = "VS_TRL_BATON"
_CHILD: Baton | None = None


class Baton:
    """A child's side: `before_step()` before each timed step, `done()` at the end."""

    def __init__(self, read_fd: int, write_fd: int, block: int) -> None:
        self.read_fd, self.write_fd, self.block = read_fd, write_fd, block
        self.holding, self.steps, self.ready = False, 0, False

    @classmethod
    def of_child(cls, block: int) -> Baton | None:
        """This child's baton (one per process), or None when the run is not interleaved."""
        global _CHILD
        fds = os.environ.get(ENV)
        if not fds or block <= 0:
            return None
        if _CHILD is None:
            read_fd, write_fd = (int(x) for x in fds.split(","))
            _CHILD = cls(read_fd, write_fd, block)
        return _CHILD

    def before_step(self) -> None:
        if self.holding and self.steps >= self.block:
            os.write(self.write_fd, b"y")
            self.holding = False
        if not self.ready:  # set up: the parent starts the turns once both trainers are
            os.write(self.write_fd, b"r")
            self.ready = True
        if not self.holding:
            if os.read(self.read_fd, 1) != b"g":
                raise SystemExit("the benchmark's parent went away")
            self.holding, self.steps = True, 0
        self.steps += 1

    def done(self) -> None:
        """After the child's last work (its final evaluation too): the other trainer may run on alone."""
        if self.holding:
            os.write(self.write_fd, b"d")


def child_env(env: dict[str, str]) -> tuple[dict[str, str], tuple[int, int], tuple[int, int]]:
    """The environment for a child and the pipes: (env, the child's (read, write), the parent's (read, write))."""
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    return env | {ENV: f"{to_child_r},{from_child_w}"}, (to_child_r, from_child_w), (from_child_r, to_child_w)


def take_turns(procs: dict[str, subprocess.Popen], pipes: dict[str, tuple[int, int]], first: str) -> list[str]:
    """Give the turn to `first`, then alternate at each yield until every child is done or has exited; return
    the order of the turns given (the kinds)."""
    live = {k: fds for k, fds in pipes.items() if _wait(procs[k], fds[0]) == b"r"}  # both set up
    turns: list[str] = []
    kind = first if first in live else next(iter(live), first)
    while live:
        read_fd, write_fd = live[kind]
        os.write(write_fd, b"g")
        turns.append(kind)
        message = _wait(procs[kind], read_fd)
        if message != b"y":  # done, or the child died
            del live[kind]
        others = [k for k in live if k != kind]
        kind = others[0] if others else kind
    return turns


def finish(procs: dict[str, subprocess.Popen], pipes: dict[str, tuple[int, int]]) -> None:
    """Wait for the children to exit and close the parent's ends."""
    for kind, proc in procs.items():
        proc.wait()
        for fd in pipes[kind]:
            os.close(fd)


def _wait(proc: subprocess.Popen, read_fd: int) -> bytes:
    while True:
        ready, _, _ = select.select([read_fd], [], [], 1.0)
        if ready:
            return os.read(read_fd, 1) or b"d"  # EOF: the child closed its end (exited)
        if proc.poll() is not None:
            return b"d"


"""`VLLMServer.stop` removes the shared-memory segments its process group had mapped: vLLM's message queues
are not registered with Python's resource tracker, so a signalled server leaves them in /dev/shm (160-250 MiB
each). A real process group stands in for the server here (the vLLM tests run the real one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from tokenmill.engines.vllm.launch import VLLMServer

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir() or not Path("/proc/self/maps").exists(),
                                reason="Linux /dev/shm and /proc")

# maps a segment of its own (left untracked, as vLLM does), one the test made and a named semaphore (a spawn
# context's lock: /dev/shm/sem.mp-*, mapped under a temporary name that sem_open unlinks), then waits for its signal
CHILD = """
import multiprocessing, sys, time
from multiprocessing import resource_tracker, shared_memory
own = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(own._name, "shared_memory")
theirs = shared_memory.SharedMemory(name=sys.argv[1])
resource_tracker.unregister(theirs._name, "shared_memory")
lock = multiprocessing.get_context("spawn").Lock()
resource_tracker.unregister(lock._semlock.name, "semaphore")
print(own.name, "sem." + lock._semlock.name.lstrip("/"), flush=True)
time.sleep(600)
"""


@pytest.fixture
def group():
    """(the process, its segment, its semaphore, our segment's name); a failed test leaves none of them."""
    ours = shared_memory.SharedMemory(create=True, size=1 << 16)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, ours.name], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    leaked, sem = (Path("/dev/shm") / name for name in proc.stdout.readline().split())
    try:
        yield proc, leaked, sem, ours.name
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        proc.stdout.close()
        leaked.unlink(missing_ok=True)
        sem.unlink(missing_ok=True)
        ours.close()
        ours.unlink()


def test_stop_removes_the_groups_segments_and_keeps_ours(tmp_path, group):
    proc, leaked, sem, ours = group
    assert leaked.exists() and sem.exists()
    VLLMServer("http://127.0.0.1:1", proc, tmp_path / "server.log").stop(timeout_s=10)
    assert proc.returncode is not None
    assert not leaked.exists() and not sem.exists()
    assert (Path("/dev/shm") / ours).exists()  # still mapped here: not the server's to remove


def test_stop_removes_the_segments_of_a_group_killed_from_outside(tmp_path, group):
    """A server's group killed with SIGKILL before `stop` (the failover test does this) has no maps left to
    read: the segments noted while it was up are removed all the same, a semaphore among them."""
    proc, leaked, sem, ours = group
    server = VLLMServer("http://127.0.0.1:1", proc, tmp_path / "server.log")
    server.note_segments()  # what start_server does once the server answers
    assert {leaked, sem} <= server.segments
    assert sem.stat().st_size == 32  # a semaphore, found by its inode (its mapping's path is deleted)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert leaked.exists() and sem.exists()  # SIGKILL leaves them behind
    server.stop(timeout_s=10)
    assert not leaked.exists() and not sem.exists()
    assert (Path("/dev/shm") / ours).exists()

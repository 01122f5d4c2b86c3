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

# maps a segment of its own (left untracked, as vLLM does) and one the test made, then waits for its signal
CHILD = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
own = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(own._name, "shared_memory")
theirs = shared_memory.SharedMemory(name=sys.argv[1])
resource_tracker.unregister(theirs._name, "shared_memory")
print(own.name, flush=True)
time.sleep(600)
"""


def test_stop_removes_the_groups_segments_and_keeps_ours(tmp_path):
    ours = shared_memory.SharedMemory(create=True, size=1 << 16)
    try:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, ours.name], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
        name = proc.stdout.readline().strip()
        leaked = Path("/dev/shm") / name
        assert name and leaked.exists()
        VLLMServer("http://127.0.0.1:1", proc, tmp_path / "server.log").stop(timeout_s=10)
        assert proc.returncode is not None
        assert not leaked.exists()
        assert (Path("/dev/shm") / ours.name).exists()  # still mapped here: not the server's to remove
    finally:
        ours.close()
        ours.unlink()


def test_stop_removes_the_segments_of_a_group_killed_from_outside(tmp_path):
    """A server's group killed with SIGKILL before `stop` (the failover test does this) has no maps left to
    read: the segments noted while it was up are removed all the same."""
    ours = shared_memory.SharedMemory(create=True, size=1 << 16)
    try:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, ours.name], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
        leaked = Path("/dev/shm") / proc.stdout.readline().strip()
        server = VLLMServer("http://127.0.0.1:1", proc, tmp_path / "server.log")
        server.note_segments()  # what start_server does once the server answers
        assert leaked in server.segments
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert leaked.exists()  # SIGKILL leaves it behind
        server.stop(timeout_s=10)
        assert not leaked.exists()
        assert (Path("/dev/shm") / ours.name).exists()
    finally:
        ours.close()
        ours.unlink()

"""Forked reward workers and spawned servers die with the process that started them, even on kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

TRAINER = textwrap.dedent("""
    import sys, time
    from tokenmill.rewards.base import FunctionReward

    def slow(prompts, completions, **_):
        if completions[0] == "spin":
            while True:  # a reward stuck in a busy loop when the trainer dies
                pass
        return [1.0] * len(completions)

    rewards = [FunctionReward(slow, name=f"r{i}", isolation="process") for i in range(2)]
    for r in rewards:
        assert r(["p"], ["c"], {})[0].value == 1.0
    pids = [r._call._proc.pid for r in rewards]
    print(" ".join(map(str, pids)), flush=True)
    if sys.argv[1] == "spin":
        import threading
        threading.Thread(target=rewards[0], args=(["p"], ["spin"], {}), daemon=True).start()
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped (an orphan's zombie goes to init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("state", ["idle", "spin"])
def test_reward_workers_die_with_a_killed_trainer(tmp_path, state):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    trainer = subprocess.Popen([sys.executable, str(script), state], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in trainer.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        time.sleep(0.3)  # the spinning call is under way
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=10)
        assert _wait_gone(pids, 5.0) == []
    finally:
        if trainer.poll() is None:
            trainer.kill()
        for pid in locals().get("pids", []):  # never leave them behind, even when the test fails
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


SPAWNER = textwrap.dedent("""
    import subprocess, sys, time
    from tokenmill.sandbox.lifetime import preexec_die_with_parent

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             preexec_fn=preexec_die_with_parent())
    print(child.pid, flush=True)
    time.sleep(600)
""")


def test_spawned_program_dies_with_a_killed_parent(tmp_path):
    """What `spawn_servers` does for `tokenmill serve`: the death signal set before exec survives it."""
    _kill_parent_then_check_child(tmp_path, SPAWNER, settle_s=0.0)



def test_a_reward_worker_ignores_ctrl_c_meant_for_its_trainer():
    """Ctrl-C reaches the whole foreground process group; the trainer handles it, the worker must not die
    (or print a KeyboardInterrupt traceback) on its own."""
    from tokenmill.rewards.base import FunctionReward

    def score(prompts, completions, **_):
        return [float(len(c)) for c in completions]

    reward = FunctionReward(score, isolation="process")
    try:
        assert reward(["p"], ["abc"], {})[0].value == 3.0
        os.kill(reward._call._proc.pid, signal.SIGINT)
        time.sleep(0.3)
        assert reward._call._proc.is_alive()
        assert reward(["p"], ["abcd"], {})[0].value == 4.0
    finally:
        reward.close()


def test_stop_process_terminates_then_kills_what_ignores_it():
    from tokenmill.sandbox.lifetime import stop_process

    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stop_process(polite, timeout_s=10)
    assert polite.returncode == -signal.SIGTERM
    stubborn = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout.readline().strip() == "ready"  # its handler is in place
    t0 = time.monotonic()
    stop_process(stubborn, timeout_s=0.5)
    assert stubborn.returncode == -signal.SIGKILL and time.monotonic() - t0 < 10
    stubborn.stdout.close()


THREAD_SPAWNER = textwrap.dedent("""
    import os, subprocess, sys, threading, time
    from tokenmill.sandbox.lifetime import parent_env, preexec_die_with_parent

    CHILD = "from tokenmill.sandbox.lifetime import watch_parent; import time; watch_parent(); time.sleep(600)"
    started = []

    def start():  # a thread that ends at once: a death signal tied to it would kill the child now
        started.append(subprocess.Popen([sys.executable, "-c", CHILD], env=parent_env(dict(os.environ)),
                                        preexec_fn=preexec_die_with_parent()))

    t = threading.Thread(target=start)
    t.start()
    t.join()
    print(started[0].pid, flush=True)
    time.sleep(600)
""")


def test_program_started_from_a_thread_outlives_it_and_dies_with_the_parent(tmp_path):
    # 1.5 s: the starting thread is long gone, and the child's watcher runs
    _kill_parent_then_check_child(tmp_path, THREAD_SPAWNER, settle_s=1.5)


def _kill_parent_then_check_child(tmp_path, spawner: str, settle_s: float) -> None:
    """Run `spawner` (it prints its child's pid), check the child is alive after `settle_s`, SIGKILL the
    spawner and check the child is gone within 5 s."""
    script = tmp_path / "spawner.py"
    script.write_text(spawner)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        time.sleep(settle_s)
        assert _alive(child), "the child died before its parent"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        assert _wait_gone([child], 5.0) == []
    finally:
        if parent.poll() is None:
            parent.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)

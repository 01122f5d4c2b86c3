"""One writer per run folder: a second run is refused naming the holder; a dead holder's lock is free."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tokenmill.checkpoint.lock import RunFolderLocked, lock_run_folder
from tokenmill.testing.crash import _command, run_to_end, write_config


def test_second_lock_is_refused_naming_the_holder_and_release_frees_it(tmp_path):
    first = lock_run_folder(tmp_path / "run").adopt()  # a built run's
    assert (tmp_path / "run" / ".lock").read_text().startswith(f"pid {os.getpid()} on ")
    with pytest.raises(RunFolderLocked, match=f"in use by another run \\(pid {os.getpid()} on "):
        lock_run_folder(tmp_path / "run")
    first.release()
    assert not first.held
    again = lock_run_folder(tmp_path / "run")
    again.release()


def test_a_lock_left_by_a_failed_build_in_this_process_does_not_refuse_the_retry(tmp_path):
    """A build that raised before its run existed leaves its lock unadopted, kept alive by the traceback that a
    notebook or pytest.raises holds: the retry in the same process takes the folder over."""
    left = lock_run_folder(tmp_path)  # never adopted: the build failed
    retry = lock_run_folder(tmp_path).adopt()
    assert not left.held and retry.held
    with pytest.raises(RunFolderLocked):  # the retry's run now holds it
        lock_run_folder(tmp_path)
    retry.release()


def test_two_real_train_processes_on_one_folder(tmp_path, tiny_model_path):
    """The first `tokenmill train` holds (mid-checkpoint) while a second starts on its folder: the second exits 2
    with one line naming the first's pid and writes nothing there. Once the first is SIGKILLed its lock is free:
    a resume takes the folder over and finishes."""
    config = write_config(tmp_path, tiny_model_path, steps=2, deterministic=False)
    out = tmp_path / "run"
    log = tmp_path / "first.txt"
    env = {**os.environ, "TOKENMILL_TEST_HOLD": "checkpoint-model@1"}
    with open(log, "w") as stderr:
        first = subprocess.Popen(_command(config, resume=False), stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    try:
        deadline = time.monotonic() + 300
        while "holding at checkpoint-model@1" not in log.read_text():
            assert first.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the first run never reached its checkpoint"
            time.sleep(0.1)
        rows = (out / "metrics.jsonl").read_text()
        second = run_to_end(config, timeout=300)
        assert second.returncode == 2, second.stderr[-2000:]
        lines = second.stderr.strip().splitlines()
        assert lines[-1].startswith(f"tokenmill: {out} is in use by another run (pid {first.pid} on "), lines
        assert (out / "metrics.jsonl").read_text() == rows  # the refused run wrote nothing into the folder
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    resumed = run_to_end(config, resume=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (out / "final" / "config.json").is_file()
    assert (out / ".lock").read_text().startswith("pid ")  # the file stays; only the kernel's lock went


def test_an_offline_run_takes_the_lock_and_gives_it_back(tmp_path, tiny_model_path):
    """`tokenmill.sft` into a folder another run holds is refused naming it; once free, it trains and leaves the
    folder free behind it."""
    import tokenmill

    tree = {"model": {"path": tiny_model_path}, "data": {"task": "addition", "num_train": 8}, "steps": 1,
            "batch_size": 4, "output_dir": str(tmp_path / "sft")}
    other = lock_run_folder(tmp_path / "sft").adopt()
    with pytest.raises(RunFolderLocked, match=f"pid {os.getpid()} on "):
        tokenmill.sft(tree)
    other.release()
    assert len(tokenmill.sft(tree)["losses"]) == 1
    lock_run_folder(tmp_path / "sft").adopt().release()  # free again

"""`checkpoint.preempt.Preemption`: what a step boundary is asked (real signals to this process), and the ranks'
agreement on it over a real two-process gloo group (what torchrun's ranks do: a signal to any one rank makes
every rank save and stop at the same step). The whole CLI path is tests/e2e/test_signals.py."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tokenmill.checkpoint.preempt import EXIT_PREEMPTED, NONE, SAVE, STOP, Preempted, Preemption


def test_sigusr1_asks_one_save_and_the_handlers_are_put_back(tmp_path):
    said: list[str] = []
    before = signal.getsignal(signal.SIGTERM)
    with Preemption(5, root=tmp_path, steps=10, say=said.append) as preempt:
        assert signal.getsignal(signal.SIGTERM) == preempt._on_signal
        assert preempt.asked(1) == NONE
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preempt.asked(2) == SAVE
        preempt.saved(2, tmp_path / "step_00000002")
        assert said == [f"SIGUSR1: checkpoint of step 2 saved to {tmp_path / 'step_00000002'}; training goes on"]
        assert preempt.asked(3) == NONE  # one signal, one save
    assert signal.getsignal(signal.SIGTERM) == before


def test_sigterm_asks_a_stop_and_the_save_raises_preempted_with_the_line(tmp_path):
    with Preemption(5, root=tmp_path, steps=10) as preempt:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM changes nothing
        assert preempt.asked(4) == STOP
        with pytest.raises(Preempted) as stopped:
            preempt.saved(4, tmp_path / "step_00000004")
    assert stopped.value.exit_code == EXIT_PREEMPTED == 75
    assert (stopped.value.signal_name, stopped.value.step) == ("SIGTERM", 4)
    assert str(stopped.value).startswith(f"stopped by SIGTERM after step 4 of 10: checkpoint saved to "
                                         f"{tmp_path / 'step_00000004'} ")


def test_a_second_sigint_raises_keyboard_interrupt_at_once(tmp_path):
    with Preemption(5, root=tmp_path) as preempt:
        os.kill(os.getpid(), signal.SIGINT)
        assert preempt.stop_signal == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_no_handlers_with_timeout_zero_or_off_the_main_thread(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with Preemption(0, root=tmp_path):
        assert signal.getsignal(signal.SIGTERM) == before
    seen: list[object] = []

    def other_thread() -> None:
        with Preemption(5, root=tmp_path):
            seen.append(signal.getsignal(signal.SIGTERM))

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    assert seen == [before]


def _rank(rank: int, init: str, results) -> None:
    """Rank 1 alone gets SIGUSR1 before boundary 2 and SIGTERM before boundary 3; both ranks say what they saw."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)

    def max_over_ranks(value: int) -> int:  # what training.dist.max_over_ranks does (without importing the engines)
        t = torch.tensor([value])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    seen = []
    with Preemption(30, root=Path("."), steps=10, agree=max_over_ranks, say=lambda _: None) as preempt:
        for step, sig in ((1, None), (2, signal.SIGUSR1), (3, signal.SIGTERM)):
            if rank == 1 and sig is not None:
                os.kill(os.getpid(), sig)
            seen.append(preempt.asked(step))
            try:
                preempt.saved(step, Path(f"step_{step:08d}"))
            except Preempted as exc:
                seen.append(exc.signal_name)
    results.put((rank, seen))
    dist.destroy_process_group()


def test_a_signal_to_one_rank_is_agreed_on_by_both(tmp_path):
    """Two gloo ranks in spawned processes; only rank 1 is signalled: both save after SIGUSR1, both stop after
    SIGTERM, at the same step (~15 s: two fresh interpreters import torch)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_rank, args=(r, init, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert got == [(0, [NONE, SAVE, STOP, "a signal to another rank"]), (1, [NONE, SAVE, STOP, "SIGTERM"])]

"""`benchmarks/vs_trl_parts/baton.py` (`vs_trl.py --interleave N`): two real child processes take turns by
blocks of N steps, never step at the same time, and each finishes its own steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from vs_trl_parts import baton

CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from vs_trl_parts.baton import Baton
turn = Baton.of_child(int(sys.argv[3]))
steps = []
for _ in range(int(sys.argv[4])):
    turn.before_step()
    start = time.monotonic()
    time.sleep(0.002)
    steps.append((start, time.monotonic()))
open(sys.argv[2], "w").write(json.dumps(steps))
turn.done()
"""


def test_two_children_take_turns_by_blocks(tmp_path):
    procs, pipes = {}, {}
    counts = {"a": 25, "b": 13}
    for kind, n in counts.items():
        env, child_fds, pipes[kind] = baton.child_env(dict(os.environ))
        procs[kind] = subprocess.Popen([sys.executable, "-c", CHILD, str(BENCHMARKS), str(tmp_path / kind), "10",
                                        str(n)], env=env, pass_fds=child_fds)
        for fd in child_fds:
            os.close(fd)
    turns = baton.take_turns(procs, pipes, "a")
    baton.finish(procs, pipes)
    assert all(p.returncode == 0 for p in procs.values())
    # a: 10 + 10 + 5 steps, b: 10 + 3; after b is done, a keeps the turn
    assert turns == ["a", "b", "a", "b", "a"]
    steps = {k: json.loads((tmp_path / k).read_text()) for k in counts}
    assert {k: len(v) for k, v in steps.items()} == counts
    for sa, ea in steps["a"]:
        for sb, eb in steps["b"]:
            assert ea <= sb or eb <= sa, "steps of the two children overlapped"

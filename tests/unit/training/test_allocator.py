"""`training.allocator.keep_freed_memory`: a loop that, like a training step, holds a few MiB of activations
and frees them faults its pages in once with it, at every round without it (glibc gives the free top of its
heap back to the system; each case in a fresh interpreter: the setting is per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, resource, torch
from tokenmill.training.allocator import keep_freed_memory
tuned = keep_freed_memory()
def step():
    held = [torch.ones(256, 1024) for _ in range(8)]  # 8 x 1 MiB, freed together at the end of the round
    return sum(float(t.sum()) for t in held)
for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(25):
    step()
print(json.dumps({"tuned": tuned, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")


def probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "TOKENMILL_MALLOC"))}
    done = subprocess.run([sys.executable, "-c", PROBE], env=clean | env | {"OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    tuned, plain = probe(), probe(TOKENMILL_MALLOC_TUNING="0")
    assert tuned["tuned"] and not plain["tuned"]
    # 25 rounds x 8 MiB = 51,200 pages: without the setting most come back as fresh pages
    assert plain["faults"] > 10_000, plain
    assert tuned["faults"] < plain["faults"] / 20, (tuned, plain)


def test_glibcs_own_settings_win():
    assert probe(MALLOC_TRIM_THRESHOLD_="131072")["tuned"] is False

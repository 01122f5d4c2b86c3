"""`training.deterministic`: bit-exact runs, so kill -9 + resume ends with the weights of an uninterrupted run.

By default torch picks its fastest kernels, some of which are not bit-reproducible: on CPU, MKL's GEMM
may take code paths that depend on the memory alignment of its inputs (tensors loaded from a checkpoint
sit at different addresses than the ones an uninterrupted run kept), and reduction orders follow the
thread count; on CUDA, atomics-based kernels and cuBLAS workspaces reorder sums. Each difference is
~1e-7 and training amplifies it. Deterministic mode asks for the reproducible path everywhere it exists
and fixes the thread count, at some cost in speed (measured numbers in docs/reliability.md).
"""

from __future__ import annotations

import os

import torch

THREADS_ENV = "TOKENMILL_DETERMINISTIC_THREADS"


def deterministic_threads() -> int:
    """The fixed intra-op thread count: $TOKENMILL_DETERMINISTIC_THREADS, else 1 (a reduction's order, so
    its rounding, then never depends on how many cores the machine or a resumed job happens to get)."""
    return max(1, int(os.environ.get(THREADS_ENV, "1")))


def make_deterministic() -> int:
    """Switch this process to reproducible kernels and a fixed thread count; return that count."""
    # read when MKL / cuBLAS initialise: effective when set before the first matrix product
    os.environ.setdefault("MKL_CBWR", "COMPATIBLE")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    threads = deterministic_threads()
    torch.set_num_threads(threads)
    return threads

"""One warm-started quickstart model for every learning test of the session (~40 s to build)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def warm(tmp_path_factory):
    from tokenmill.recipes import warm_start

    torch.set_num_threads(2)
    return warm_start(tmp_path_factory.mktemp("quickstart"), num_eval=500, say=lambda _: None)

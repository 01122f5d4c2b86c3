"""Fixtures of the contract tests (helpers they share are in contract_helpers.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM


@pytest.fixture
def reference(tiny_model_path):
    """The tiny model as saved: what every engine starts from."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()

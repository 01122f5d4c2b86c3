"""The tiny model kit (`tokenmill.testing.build_tiny_model`): what it builds is what loads back."""

from __future__ import annotations

import json
from pathlib import Path


def test_the_tokenizer_reloads_padding_on_the_left(tiny_model_path):
    from transformers import AutoTokenizer

    from tokenmill.recipes.tiny import build_tokenizer

    assert build_tokenizer().padding_side == "left"
    assert json.loads((Path(tiny_model_path) / "tokenizer_config.json").read_text())["padding_side"] == "left"
    reloaded = AutoTokenizer.from_pretrained(tiny_model_path)
    assert reloaded.padding_side == "left"
    batch = reloaded(["1+1=", "12+34="], padding=True)["input_ids"]
    assert batch[0][:2] == [reloaded.pad_token_id] * 2 and batch[1][0] != reloaded.pad_token_id

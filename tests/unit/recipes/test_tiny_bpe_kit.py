"""The tiny byte-level BPE kit: a folder that loads back with `from_pretrained`, digits merged where its
pre-tokenisation lets them, the character tokenizer's special tokens and chat template."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenmill.recipes.tiny import build_tokenizer
from tokenmill.recipes.tiny_bpe import LEADING_ONE, build_tiny_bpe_model


def _pieces(tok, text):
    return tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])


def test_folders_load_back_and_split_digits_as_set(tmp_path):
    runs = AutoTokenizer.from_pretrained(build_tiny_bpe_model(tmp_path / "runs", hidden_size=32, num_layers=1))
    assert _pieces(runs, "98+37=135") == ["98", "+", "37", "=", "13", "5"]
    path = build_tiny_bpe_model(tmp_path / "one", hidden_size=32, num_layers=1, split=LEADING_ONE)
    one = AutoTokenizer.from_pretrained(path)
    assert _pieces(one, "98+37=135") == ["9", "8", "+", "3", "7", "=", "13", "5"]
    assert _pieces(one, "12+7=19") == ["1", "2", "+", "7", "=", "1", "9"]
    char = build_tokenizer()
    assert one.eos_token == char.eos_token == "<|end|>" and one.chat_template == char.chat_template
    assert one.decode(one("aé 1")["input_ids"]) == "aé 1"
    assert AutoModelForCausalLM.from_pretrained(path).config.vocab_size == len(one)

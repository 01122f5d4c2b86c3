"""A tiny byte-level BPE tokenizer and a Llama over it: a model whose tokenizer differs from the quickstart's
character-level one (a teacher for cross-tokenizer distillation, `training.cross_tokenizer`).

The tokenizer is trained locally with the `tokenizers` library on addition problems (`a+b=c`), so its merges
join digits into multi-digit tokens (`98`, `135`) where the character tokenizer has one token per digit; it has
the same chat special tokens and chat template as the character tokenizer, with other ids. Nothing is
downloaded; the folder loads back with `from_pretrained`.

    >>> path = build_tiny_bpe_model("/tmp/bpe", hidden_size=64, num_layers=2)   # doctest: +SKIP
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenmill.recipes.tiny import SPECIAL_TOKENS, chat_tokenizer, save_folder


def addition_corpus(n: int = 4000, seed: int = 0) -> list[str]:
    """`n` lines `a+b=c` with operands of up to two digits: what the BPE merges are learnt from."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(f"{a}+{b}={a + b}")
    return lines


# Pre-tokenisation that keeps digits single except the leading `1` of a three-digit number, joined with the next
# digit (`135` -> `13`, `5`): a tokenizer that differs from the character one where sums pass 100 and that a tiny
# model still learns to add with (free merges of digit runs, `98`, `37`, make addition a table to memorise).
LEADING_ONE = r"1\d(?=\d)|\d|\D"


def build_bpe_tokenizer(vocab_size: int = 400, corpus: list[str] | None = None, split: str | None = None):
    """A fast byte-level BPE tokenizer trained on `corpus` (default: `addition_corpus()`). Pre-tokenisation is
    GPT-2's (digit runs stay together, so merges form multi-digit tokens: `98`, `13`), or with `split` (a
    regex, e.g. `LEADING_ONE`) the text is first cut into its matches, merges staying inside them. The chat
    special tokens come first
    (at the same ids as the character tokenizer's, `<|end|>` eos; every other token has another id) and the same chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split is not None:
        core.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(corpus if corpus is not None else addition_corpus(), trainer=trainer)
    return chat_tokenizer(core, list(SPECIAL_TOKENS))


def build_tiny_bpe_model(path: str | Path, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4,
                         num_kv_heads: int = 2, vocab_size: int = 400, split: str | None = None, seed: int = 0) -> str:
    """Write a random-init Llama causal LM over `build_bpe_tokenizer(vocab_size, split=split)` to `path`; return
    the path."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = build_bpe_tokenizer(vocab_size, split=split)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    return str(save_folder(AutoModelForCausalLM.from_config(config, dtype=torch.float32), tok, path))

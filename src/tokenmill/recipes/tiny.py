"""Build a tiny causal LM and a character-level tokenizer locally, saved as a normal HF folder.

Nothing is downloaded: the tokenizer is a `tokenizers` WordLevel model over single characters (with a
`Fuse` decoder so decoded text has no spaces between characters) plus chat special tokens and a chat
template; the model is a randomly initialised Llama (a Qwen2 folder would be loaded by transformers v5
with Qwen2's own byte-level tokenizer class, which drops spaces from a character vocabulary). Load the folder back with `from_pretrained`.

    >>> path = build_tiny_model("/tmp/tiny", hidden_size=64, num_layers=2)   # doctest: +SKIP
    >>> AutoModelForCausalLM.from_pretrained(path)                          # doctest: +SKIP
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<unk>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
CHARACTERS = string.digits + "+-*/=()<>.,:;!?'\"[]{}_#%&@^|~$`\\ \n" + string.ascii_letters


def build_tokenizer(extra_special_tokens: tuple[str, ...] = ()):
    """A fast character-level tokenizer with chat special tokens (and `extra_special_tokens` after them, e.g. a
    vision-language model's image markers); eos is `<|end|>`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = [*SPECIAL_TOKENS, *extra_special_tokens]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return chat_tokenizer(core, specials)


def chat_tokenizer(core: Any, specials: list[str]):
    """A transformers fast tokenizer over the `tokenizers` object `core`: pad/unk/eos are `specials`' first three
    (`SPECIAL_TOKENS`), the rest additional special tokens; left padding and the chat template."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=specials[0],
        unk_token=specials[1],
        eos_token=specials[2],
        additional_special_tokens=specials[3:],
        clean_up_tokenization_spaces=False,
        padding_side="left",  # a constructor argument is saved with the folder; an attribute set later is not
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(
    path: str | Path,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_positions: int = 512,
    seed: int = 0,
    tie_word_embeddings: bool = True,
) -> str:
    """Write a random-init Llama causal LM and the character tokenizer to `path`; return the path.
    `tie_word_embeddings=False` gives the output head its own copy of the embedding matrix (same logits; the
    two then train apart), which engines that cannot reload a tied head in place need (vLLM on CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if not tie_word_embeddings:  # the head starts as the embedding (as a tied model's), then trains apart
        with torch.no_grad():
            model.lm_head.weight.copy_(model.get_input_embeddings().weight)
    return str(save_folder(model, tok, path))


def save_folder(model, tok, path: str | Path) -> Path:
    """Save `model` (its generation config ending and padding with the tokenizer's tokens) and `tok` to `path`."""
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def build_tiny_moe_model(
    path: str | Path,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    expert_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 512,
    seed: int = 0,
    init_std: float = 0.1,
) -> str:
    """Write a random-init Qwen3-MoE causal LM (every layer a mixture of `num_experts` experts, `top_k` per
    token, top-k weights renormalised) and the character tokenizer to `path`; return the path. `init_std`
    (transformers' 0.02 by default) is larger so that experts differ enough for a routing flip to show in
    the logits, as in a trained MoE."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    tok = build_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        moe_intermediate_size=expert_size,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        initializer_range=init_std,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return str(save_folder(AutoModelForCausalLM.from_config(config, dtype=torch.float32), tok, path))

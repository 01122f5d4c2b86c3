"""SFT on chat data: the loss mask covers exactly the assistant messages, the tokens are those of the full
rendering, and sequence packing gives the same logprobs and gradients as padded rows."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.algorithms import token_weights
from tokenmill.data.chat import ChatTemplateError, chat_tokens
from tokenmill.data.tasks import shout_chats
from tokenmill.training import LocalBackend, collate
from tokenmill.training.local import batch_logprobs
from tokenmill.training.packing import micro_packs, sequence_segments
from tokenmill.training.sft import _loss, chat_sample, run_sft

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "6, I think"},
]


def test_mask_covers_exactly_the_assistant_messages(tokenizer):
    ids, mask = chat_tokens(tokenizer, CHAT)
    # no drift: the ids are those of the whole conversation rendered and tokenized at once
    assert ids == tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    # each assistant message's content and the end-of-turn marker the template writes after it; never the
    # `<|assistant|>` header the template writes before it, nor any system or user token
    assert tokenizer.decode(trained) == "4<|end|>6, I think<|end|>"
    text = tokenizer.decode(ids)
    assert text.count("<|assistant|>") == 2
    header = tokenizer.convert_tokens_to_ids("<|assistant|>")
    starts = [t for t in range(1, len(ids)) if mask[t] and not mask[t - 1]]
    assert len(starts) == 2 and all(ids[t - 1] == header for t in starts)


def test_chat_sample_and_roles(tokenizer):
    s = chat_sample(tokenizer, CHAT)
    assert s.prompt_len == s.loss_mask.index(1) and s.completion.startswith("4")
    assert sum(s.loss_mask) == len("4") + 1 + len("6, I think") + 1
    # other roles can be trained too (e.g. a tool-calling demonstration where the user turns are generated)
    ids, mask = chat_tokens(tokenizer, CHAT, train_roles=("user",))
    assert tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "<|user|>2+2?<|end|><|user|>and 3+3?<|end|>"


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    # a template that shows only the last assistant message (as reasoning-stripping templates do to history)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "<|end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="^message 2 \\(assistant\\)"):
        chat_tokens(tok, CHAT)


def _chat_batch(tokenizer, n: int = 7, seed: int = 0):
    rows = shout_chats(n, seed=seed, turns=random.Random(seed).choice([1, 2, 3]))
    samples = [chat_sample(tokenizer, r["messages"]) for r in rows]
    weights = token_weights([sum(s.loss_mask) for s in samples], "token_mean")
    return samples, collate(samples, weights, pad_id=tokenizer.pad_token_id)


@pytest.mark.parametrize("budget", [10_000, 40])
def test_sequence_packing_matches_padded_rows(tiny_model, tokenizer, budget):
    _, batch = _chat_batch(tokenizer)
    plain = batch_logprobs(tiny_model, batch, temperature=1.0, token_budget=10_000, share_prompts=False)
    packed_micro = list(micro_packs(batch, budget, sequence_segments(batch)))
    # several sequences share a row (with a budget that allows it): no padding between them
    assert max(len(set(p.dst_b_K.tolist())) for _, p in packed_micro) > (1 if budget > 100 else 0)
    from tokenmill.training.local import micro_token_stats

    out = torch.zeros_like(plain)
    for rows, _, lp, _ in micro_token_stats(tiny_model, batch, temperature=1.0, token_budget=budget,
                                            pack_sequences=True):
        out[rows, : lp.shape[1]] = lp.detach()
    # every token but each sequence's first (nothing predicts it) gets the same logprob
    lengths = batch.lengths_B.tolist()
    for b, n in enumerate(lengths):
        torch.testing.assert_close(out[b, 1:n], plain[b, 1:n], atol=1e-5, rtol=0)


def test_packed_sft_gradients_equal_padded(tiny_model_path, tokenizer):
    from transformers import AutoModelForCausalLM

    _, batch = _chat_batch(tokenizer, seed=1)
    grads = []
    for pack in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        backend = LocalBackend(model, learning_rate=1e-3, total_steps=1, micro_batch_tokens=64,
                               share_prompts=False, pack_sequences=pack, track_entropy=False)
        metrics = backend.forward_backward(batch, _loss)
        grads.append(({n: p.grad.clone() for n, p in model.named_parameters()}, metrics["nll"]))
    (plain, nll_plain), (packed, nll_packed) = grads
    assert nll_packed == pytest.approx(nll_plain, rel=1e-5)
    for name in plain:
        torch.testing.assert_close(packed[name], plain[name], atol=2e-6, rtol=1e-4, msg=name)


def test_sft_on_chats_lowers_assistant_loss_only(tiny_model_path, tokenizer):
    """A few packed SFT steps on conversations: the assistant-token NLL falls, the user-token NLL (random
    letters it is never trained on) does not."""
    from transformers import AutoModelForCausalLM

    from tokenmill.data.chat import chat_tokens as tokens_of

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    held = shout_chats(40, seed=7)

    def nll(role: str) -> float:
        samples = []
        for r in held:
            ids, mask = tokens_of(tokenizer, r["messages"], train_roles=(role,))
            samples.append(chat_sample(tokenizer, r["messages"]).with_(tokens=tuple(ids), loss_mask=tuple(mask)))
        batch = collate(samples, [1.0] * len(samples), tokenizer.pad_token_id)
        lp = batch_logprobs(model, batch, temperature=1.0, token_budget=10_000, share_prompts=False)
        return float(-(lp * batch.weights_B_T).sum() / batch.weights_B_T.sum())

    before = nll("assistant"), nll("user")
    losses = run_sft(model, tokenizer, shout_chats(400, seed=0), steps=60, batch_size=16, learning_rate=3e-3,
                     warmup_steps=5, messages_column="messages", packing=True, micro_batch_tokens=256)
    after = nll("assistant"), nll("user")
    assert sum(losses[-5:]) / 5 < 0.7 * losses[0]
    assert after[0] < 0.7 * before[0], (before, after)
    # user tokens are letters the model is never trained to write: their loss falls far less
    assert (before[1] - after[1]) < 0.5 * (before[0] - after[0]), (before, after)

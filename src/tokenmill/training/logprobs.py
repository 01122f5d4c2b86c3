"""Token logprobs and entropies without the full logits: the LM head runs on chunks of positions.

A causal LM's forward returns logits `[B, T, V]`; in fp32 with a Qwen-sized vocabulary (151,936) that is
0.6 MB per token, and the log-softmax's backward needs as much again. The trainer only needs, per predicted
token, `logit[target] - logsumexp(logits)` (and the entropy for the bonus / metric). So the decoder runs
once (`get_decoder()`: its hidden states, `[tokens, hidden]`), and the head (`get_output_embeddings()`, tied
or not, LoRA-wrapped or not) runs on chunks of at most `chunk_bytes` of fp32 logits. With gradients each
chunk is checkpointed (`torch.utils.checkpoint`): its logits are computed again in the backward, one chunk
at a time, so neither pass ever holds more than one chunk of logits. The numbers are those of the plain path
(the same matmul, row by row; `tests/unit/training/test_logprobs.py` checks 1e-6 in fp32).

On-policy distillation's full reverse KL (`distillation.loss: full`) rides on the same chunks: given a
teacher's hidden states at the same positions (and its head), each chunk also returns
`sum_v p_s(v) (log p_s(v) - log p_t(v))`, differentiable through the student, with the teacher's logits
computed chunk by chunk under no_grad (`reverse_kl`).

`head_parts` says whether a model's logits are exactly `head(decoder(...))`; where not (a final logit
soft-cap or scale, an FSDP2-sharded root whose head is gathered only inside its own forward), callers use
the model's own forward.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch
from torch.utils.checkpoint import checkpoint

from tokenmill.algorithms.distill import bucketed_reverse_kl
from tokenmill.engines.local.fast_decode import FastDecoder, decoder_blocker
from tokenmill.training.router_replay import replaying, routes_tensor

DEFAULT_CHUNK_MIB = 64
# config fields of models whose logits are not plain head(hidden) (Gemma-2 soft-cap, Cohere / Granite scale)
_LOGIT_MODIFIERS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def token_logprobs(logits_B_T_V: torch.Tensor, input_ids_B_T: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token_t | tokens_<t) for every position, aligned with the tokens (position 0 gets 0), from full
    logits (the plain path).

    Computed as gathered logit minus logsumexp, in fp32, so no full log-softmax tensor is kept for
    backward (the term that dominates memory for large vocabularies).
    """
    logits = logits_B_T_V[:, :-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets_B_T = input_ids_B_T[:, 1:]
    picked = logits.gather(-1, targets_B_T.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.nn.functional.pad(picked, (1, 0))


def token_entropy(logits_B_T_V: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of the next-token distribution at each position, aligned like `token_logprobs`."""
    logits = logits_B_T_V[:, :-1, :].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))


def reverse_kl(student_logp_N_V: torch.Tensor, teacher_logits_N_V: torch.Tensor) -> torch.Tensor:
    """KL(student || teacher) at each of N positions, `sum_v p_s(v) (log p_s(v) - log p_t(v))`, from the
    student's log-softmax (gradients flow through it) and the teacher's logits (temperature 1, no gradient).
    Its gradient with respect to the student's logit z_v is `p_s(v) (log p_s(v) - log p_t(v) - KL)`."""
    teacher_logp_N_V = torch.log_softmax(teacher_logits_N_V.detach().float(), dim=-1)
    return (student_logp_N_V.exp() * (student_logp_N_V - teacher_logp_N_V)).sum(-1)


def token_reverse_kl(logits_B_T_V: torch.Tensor, teacher: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                     temperature: float) -> torch.Tensor:
    """`reverse_kl` at each position from full logits, aligned like `token_logprobs` (the plain path).
    `teacher`: its logits `[B, T, V]`, or its top-k ids and logprobs `[B, T, K]` aligned with the tokens
    (index t: the distribution that predicts token t), for `algorithms.distill.bucketed_reverse_kl`."""
    logp = torch.log_softmax(logits_B_T_V[:, :-1, :].float() / temperature, dim=-1)
    if isinstance(teacher, torch.Tensor):
        return torch.nn.functional.pad(reverse_kl(logp, teacher[:, :-1, :]), (1, 0))
    ids_B_T_K, top_B_T_K = teacher
    student_top = logp.gather(-1, ids_B_T_K[:, 1:].clamp(min=0))
    return torch.nn.functional.pad(bucketed_reverse_kl(student_top, top_B_T_K[:, 1:]), (1, 0))


def teacher_states(teacher: torch.nn.Module, chunked: bool, **inputs) -> tuple[torch.Tensor, torch.nn.Module]:
    """(states, head) with `teacher(...).logits == head(states)`, no gradient: its decoder's hidden states and
    its LM head where `head_parts` allows and `chunked`, else its full logits and the identity."""
    parts = head_parts(teacher) if chunked else None
    with torch.no_grad():
        if parts is None:
            return teacher(**inputs, use_cache=False).logits, torch.nn.Identity()
        return hidden_states(parts[0], **inputs), parts[1]


def head_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(decoder, head) when `model(...).logits == head(decoder(...).last_hidden_state)`, else None."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return None
    config = getattr(model, "config", None)
    if config is None or any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_MODIFIERS):
        return None
    if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
        return None  # peft prompt tuning adds virtual tokens in its own forward
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    if not type(base).__name__.endswith("ForCausalLM"):
        return None
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError, ValueError):
        return None
    if decoder is None or head is None or decoder is base:
        return None
    return decoder, head


def chunk_tokens(head: torch.nn.Module, chunk_bytes: int) -> int:
    """Positions per chunk: as many as fit `chunk_bytes` of fp32 logits (at least one)."""
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]
    return max(1, chunk_bytes // (4 * int(vocab)))


def _chunk_stats(
    head: torch.nn.Module, hidden_N_H: torch.Tensor, target_N: torch.Tensor, temperature: float,
    entropy: bool, entropy_grad: bool, autocast_dtype: torch.dtype | None,
    teacher_head: torch.nn.Module | None = None, teacher_N_X: torch.Tensor | None = None,
    teacher_top_N_K: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    autocast = torch.autocast(hidden_N_H.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    with autocast:
        logits_N_V = head(hidden_N_H)
    logits_N_V = logits_N_V.float()
    if temperature != 1.0:
        logits_N_V = logits_N_V / temperature
    lse_N = torch.logsumexp(logits_N_V, dim=-1)
    logprob_N = logits_N_V.gather(-1, target_N[:, None]).squeeze(-1) - lse_N
    kl_N = torch.zeros_like(logprob_N)
    if teacher_head is not None:  # the teacher's states: its whole distribution
        with torch.no_grad(), autocast:
            teacher_logits_N_V = teacher_head(teacher_N_X)
        kl_N = reverse_kl(logits_N_V - lse_N[:, None], teacher_logits_N_V)
    elif teacher_N_X is not None:  # the teacher's top-k ids and logprobs: the bucketed KL
        student_top_N_K = logits_N_V.gather(-1, teacher_N_X.clamp(min=0)) - lse_N[:, None]
        kl_N = bucketed_reverse_kl(student_top_N_K, teacher_top_N_K)
    if not entropy:
        return logprob_N, torch.zeros_like(logprob_N), kl_N
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        logp_N_V = logits_N_V - lse_N[:, None]  # the log-softmax, from the log-sum-exp already taken
        logp_N_V = logp_N_V if entropy_grad else logp_N_V.detach()
        ent_N = -(logp_N_V.exp() * logp_N_V).sum(-1)
    return logprob_N, ent_N, kl_N


def head_token_stats(
    head: torch.nn.Module,
    hidden_N_H: torch.Tensor,
    target_N: torch.Tensor,
    *,
    temperature: float,
    chunk_bytes: int,
    entropy: bool = False,
    entropy_grad: bool = False,
    autocast_dtype: torch.dtype | None = None,
    teacher: tuple[torch.nn.Module | None, torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(log p(target_n), the entropy or None, the reverse KL to `teacher` or None) of the head's softmax at
    each of the N hidden states, computed `chunk_tokens` positions at a time (all at once with `chunk_bytes`
    0); with gradients, each chunk's logits are computed again in the backward instead of kept. `teacher`:
    (its head, its states at the same N positions) for the full KL (see `teacher_states`), or (None, its
    top-k ids `[N, K]`, their logprobs `[N, K]`, -1 / -inf at pads) for the bucketed one."""
    n = hidden_N_H.shape[0]
    size = chunk_tokens(head, chunk_bytes) if chunk_bytes > 0 else n
    extra = (temperature, entropy, entropy_grad, autocast_dtype)
    t_head, t_N_X, t_N_K = (*teacher, None)[:3] if teacher is not None else (None, None, None)
    if n <= size:  # one chunk: nothing to save by recomputing it
        parts = [_chunk_stats(head, hidden_N_H, target_N, *extra, t_head, t_N_X, t_N_K)]
    else:
        grad = torch.is_grad_enabled() and (hidden_N_H.requires_grad or any(p.requires_grad for p in head.parameters()))
        parts = []
        for start in range(0, n, size):
            cut = slice(start, start + size)
            args = (head, hidden_N_H[cut], target_N[cut], *extra, t_head,
                    *(None if t is None else t[cut] for t in (t_N_X, t_N_K)))
            parts.append(checkpoint(_chunk_stats, *args, use_reentrant=False) if grad else _chunk_stats(*args))
    lp_N = torch.cat([p[0] for p in parts])
    ent_N = torch.cat([p[1] for p in parts]) if entropy else None
    return lp_N, ent_N, torch.cat([p[2] for p in parts]) if teacher is not None else None


def hidden_states(decoder: torch.nn.Module, **inputs) -> torch.Tensor:
    """The decoder's last hidden state (after its final norm), `[B, T, H]`: through `fast_forward` where it
    can run (the same numbers, less per-call work), else the decoder's own forward."""
    fast = fast_forward(decoder, inputs)
    if fast is None:
        return decoder(**inputs, use_cache=False).last_hidden_state
    ids_B_T = inputs["input_ids"]
    pos_B_T = inputs.get("position_ids")
    if pos_B_T is None:
        pos_B_T = torch.arange(ids_B_T.shape[1], device=ids_B_T.device).expand(ids_B_T.shape)
    return fast.hidden(ids_B_T, pos_B_T, inputs.get("attention_mask"))


_FAST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> its FastDecoder (rotary tables)
_OFF: weakref.WeakSet = weakref.WeakSet()  # decoders `set_fast_forward` turned off


def fast_forward(decoder: torch.nn.Module, inputs: dict | None = None) -> FastDecoder | None:
    """The decoder's forward as `engines.local.fast_decode.FastDecoder.hidden` (the decode step's own code, run on
    whole sequences, differentiable), or None where it does not stand in for the decoder: a model it does not
    know (`decoder_blocker`), hooks (FSDP2, a user's), gradient checkpointing, attention dropout while
    training, an attention implementation other than SDPA, inputs other than ids / positions / a bool 4-D
    mask (attention by segments goes through the decoder), or `set_fast_forward(decoder, False)`."""
    inputs = inputs or {}
    mask = inputs.get("attention_mask")
    if set(inputs) - {"input_ids", "position_ids", "attention_mask"} or (
            mask is not None and (mask.dim() != 4 or mask.dtype != torch.bool)):
        return None
    config = getattr(decoder, "config", None)
    if decoder in _OFF or config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return None
    checkpointed = any(getattr(m, "gradient_checkpointing", False) for m in (decoder, *getattr(decoder, "layers", ())))
    if checkpointed or (decoder.training and getattr(config, "attention_dropout", 0.0)):
        return None
    if decoder_blocker(decoder, config) is not None:  # checked every call: hooks come and go
        return None
    if decoder not in _FAST:
        _FAST[decoder] = FastDecoder.of_decoder(decoder)
    return _FAST[decoder]


def set_fast_forward(model: torch.nn.Module, enabled: bool) -> None:
    """Turn `fast_forward` off (or back on) for every decoder in `model` (`training.fast_forward`)."""
    for module in model.modules():
        if hasattr(module, "embed_tokens") and hasattr(module, "layers"):
            (_OFF.discard if enabled else _OFF.add)(module)


def sequence_token_stats(
    model: torch.nn.Module,
    input_ids_B_T: torch.Tensor,
    *,
    temperature: float,
    chunk_bytes: int,
    lengths_B: torch.Tensor | None = None,
    entropy: bool = False,
    entropy_grad: bool = False,
    autocast_dtype: torch.dtype | None = None,
    teacher: torch.nn.Module | tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """`(token_logprobs, token_entropy or None)` of right-padded rows, aligned with the tokens (position 0
    gets 0; so do padding positions on the chunked path): through the chunked head where `head_parts` allows
    and `chunk_bytes > 0`, else from the model's full logits. With a `teacher` (a module with the same
    vocabulary, or its top-k ids and logprobs `[B, T, K]` aligned with the tokens), a third tensor: the
    reverse KL from the model to it at each position (`reverse_kl`; bucketed for top-k)."""
    device = input_ids_B_T.device
    autocast = torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    parts = head_parts(model) if chunk_bytes > 0 else None
    if parts is None:
        with autocast:
            logits_B_T_V = model(input_ids=input_ids_B_T, use_cache=False).logits
        ent = None
        if entropy:
            ent = token_entropy(logits_B_T_V if entropy_grad else logits_B_T_V.detach(), temperature)
        out = (token_logprobs(logits_B_T_V, input_ids_B_T, temperature), ent)
        if teacher is None:
            return out
        if isinstance(teacher, torch.nn.Module):
            with autocast:
                teacher, _ = teacher_states(teacher, False, input_ids=input_ids_B_T)
        return (*out, token_reverse_kl(logits_B_T_V, teacher, temperature))
    decoder, head = parts
    B, T = input_ids_B_T.shape
    with autocast:
        hidden_B_T_H = hidden_states(decoder, input_ids=input_ids_B_T)
        taught = teacher_states(teacher, True, input_ids=input_ids_B_T) if isinstance(teacher, torch.nn.Module) else None
    lengths = torch.full((B,), T, dtype=torch.long) if lengths_B is None else lengths_B.cpu()
    real_B_T = torch.arange(T)[None, :] < lengths[:, None]  # position t >= 1 is predicted from t - 1
    real_B_T[:, 0] = False
    b_N, t_N = (i.to(device) for i in real_B_T.nonzero(as_tuple=True))
    lp_N, ent_N, kl_N = head_token_stats(
        head, hidden_B_T_H[b_N, t_N - 1], input_ids_B_T[b_N, t_N], temperature=temperature,
        chunk_bytes=chunk_bytes, entropy=entropy, entropy_grad=entropy_grad, autocast_dtype=autocast_dtype,
        teacher=_teacher_at(teacher, taught, (b_N, t_N - 1), (b_N, t_N)),
    )
    zeros_B_T = torch.zeros((B, T), dtype=torch.float32, device=device)
    out = (zeros_B_T.index_put((b_N, t_N), lp_N), None if ent_N is None else zeros_B_T.index_put((b_N, t_N), ent_N))
    return out if kl_N is None else (*out, zeros_B_T.index_put((b_N, t_N), kl_N))


def _teacher_at(teacher, taught, predicting: tuple, predicted: tuple):
    """`head_token_stats`' teacher at N positions: (its head, its states at the `predicting` positions) for
    a module (`taught`: `teacher_states`), (None, top-k ids, logprobs) at the `predicted` tokens for top-k."""
    if teacher is None:
        return None
    if taught is not None:
        return taught[1], taught[0][predicting]
    ids_B_T_K, top_B_T_K = teacher
    return None, ids_B_T_K[predicted], top_B_T_K[predicted]


def row_logprobs(model: torch.nn.Module, tokens, *, temperature: float, chunk_bytes: int,
                 autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`[L]`: the token logprobs of one sequence as a row of exactly its L tokens (no padding, no neighbour),
    through `sequence_token_stats`: what the trainer computes for it with `training.deterministic`
    (`micro_token_stats(..., batch_invariant=True)`), so an engine scoring its samples with this function on
    the same weights reports the trainer's numbers bit for bit (docs/reliability.md, "Zero mismatch"). Under
    router replay the caller wraps it in the sample's `router_replay.replaying`, as `rescore_groups` does."""
    device = next(model.parameters()).device
    ids_1_L = torch.tensor([list(tokens)], dtype=torch.long, device=device)
    lp_1_L, _ = sequence_token_stats(model, ids_1_L, lengths_B=torch.tensor([ids_1_L.shape[1]]),
                                     temperature=temperature, chunk_bytes=chunk_bytes, autocast_dtype=autocast_dtype)
    return lp_1_L[0]


def rescore_groups(model: torch.nn.Module, groups: list, *, temperature: float, chunk_bytes: int,
                   autocast_dtype: torch.dtype | None = None, version: int | None = None,
                   replay: bool = False) -> list:
    """`groups` with each trainable sample's logprobs replaced by `row_logprobs` under `model` (an in-process
    engine's: `controller.rl.exact_logprobs`), in eval mode without gradients: with `training.deterministic`
    the trainer computes exactly these numbers, so on the same weights the engine/trainer mismatch is 0 bit
    for bit. The tokens stay the ones the decode pass drew (docs/reliability.md, "Zero mismatch"); untrained
    positions keep 0. With `version` (the weights `model` holds), a sample drawn by other weights (an older
    version, a partial rollout across an update) keeps its decode logprobs: those are its behaviour policy's.
    `replay` (`training.router_replay: r3`): a mixture-of-experts model routes each sample's tokens as its
    `routes` recorded (`router_replay.replaying`, the trainer's own replay of the same `[1, L, R]` row), so
    the scoring pass goes through the experts the trainer's forward replays, not those it would pick afresh."""

    def drawn_here(s) -> bool:
        return version is None or (s.version == version and all(v == version for v in s.token_versions))

    def rescored(s):
        if not (s.trainable and any(s.loss_mask) and drawn_here(s)):
            return s
        with replaying(model, routes_tensor([s], len(s.tokens)) if replay else None):
            lp = row_logprobs(model, s.tokens, temperature=temperature, chunk_bytes=chunk_bytes,
                              autocast_dtype=autocast_dtype).tolist()
        return s.with_(logprobs=tuple(v if m else 0.0 for v, m in zip(lp, s.loss_mask, strict=True)))

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            return [replace(g, samples=tuple(rescored(s) for s in g.samples)) for g in groups]
    finally:
        model.train(was_training)

"""Router replay for mixture-of-experts policies: the trainer routes each token to the experts it was routed
to before, instead of choosing again (`training.router_replay`).

    r3  (rollout routing replay; Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training
        and Inference Routers"): the engine records its choices while it samples (`engines.local.routing`,
        `Sample.routes`) and every trainer pass (old-policy logprobs, the update) replays them, so the trainer
        scores the tokens through the experts that produced them.
    r2  (routing replay; Zheng et al. 2025, "Group Sequence Policy Optimization"): the trainer records its own
        choices in one no-grad pass before the update and replays them in every pass of the update, so the
        experts stay put while the weights move across mini-batches and epochs; the engine's routing is not
        used (a sampler/trainer routing gap stays).

Replay keeps the gate differentiable: the router's logits are computed as usual, only the top-k indices are
replaced, and the routing weights are the softmax probabilities at the replayed indices (renormalised where
the router renormalises). A token without recorded routes (-1: padding, the last sampled token, a sample
from a path that does not record) is routed by the trainer itself.

Under `training.deterministic`'s zero mismatch the engine's scoring pass routes as the trainer does: with r3
it replays the same recorded routes (`logprobs.rescore_groups`), with r2 the trainer records its own one row
per sample (`LocalBackend.record_routes`), the routes that pass picks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from tokenmill.engines.local.routing import (
    ROUTES_DTYPE,
    RoutingRecorder,
    as_routes,
    moe_routers,
    routes_width,
)
from tokenmill.types import Sample

MODES = ("off", "r2", "r3")


def routes_tensor(samples: Sequence[Sample], width: int) -> torch.Tensor | None:
    """`[B, width, R]` long of the samples' `routes`, -1 past each sample's end or where it has none; None when
    no sample has any."""
    given = [as_routes(s.routes) for s in samples]
    widths = {r.shape[-1] for r in given if r is not None}
    if not widths:
        return None
    if len(widths) > 1:
        raise ValueError(f"samples carry routes of different widths {sorted(widths)} (another model?)")
    (per_token,) = widths
    out = torch.full((len(samples), width, per_token), -1, dtype=torch.long)
    for b, r in enumerate(given):
        if r is not None:
            out[b, : r.shape[0]] = r[:width]
    return out


def _replace_topk(module: torch.nn.Module, output, chosen_N_K: torch.Tensor):
    logits_N_E, _, computed_N_K = output
    chosen_N_K = chosen_N_K.to(computed_N_K.device, computed_N_K.dtype)
    known_N_1 = (chosen_N_K >= 0).all(-1, keepdim=True)
    index_N_K = torch.where(known_N_1, chosen_N_K, computed_N_K)
    probs_N_E = torch.softmax(logits_N_E, dim=-1, dtype=torch.float)
    weights_N_K = probs_N_E.gather(1, index_N_K)
    if getattr(module, "norm_topk_prob", False):
        weights_N_K = weights_N_K / weights_N_K.sum(dim=-1, keepdim=True)
    return logits_N_E, weights_N_K.to(logits_N_E.dtype), index_N_K


@contextmanager
def replaying(model: torch.nn.Module, routes_B_T_R: torch.Tensor | None) -> Iterator[None]:
    """Within the block, a forward over input ids of shape `[B, T]` routes token (b, t) to `routes_B_T_R[b, t]`
    (layers x top_k, layer by layer; rows of -1 route themselves). None: no replay."""
    if routes_B_T_R is None:
        yield
        return
    routers = moe_routers(model)
    flat_N_R = routes_B_T_R.reshape(-1, routes_B_T_R.shape[-1])
    if flat_N_R.shape[1] != routes_width(model):
        raise ValueError(f"routes of {flat_N_R.shape[1]} experts per token, the model routes "
                         f"{routes_width(model)} (layers x top_k)")
    handles, start = [], 0
    for router in routers:
        part = flat_N_R[:, start : start + int(router.top_k)]
        handles.append(router.register_forward_hook(lambda m, i, out, part=part: _replace_topk(m, out, part)))
        start += int(router.top_k)
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def recording(model: torch.nn.Module) -> Iterator[RoutingRecorder]:
    """A `RoutingRecorder` on `model` for the block."""
    recorder = RoutingRecorder(model)
    try:
        yield recorder
    finally:
        recorder.close()


def trainer_routes(model: torch.nn.Module, batch, token_budget: int,
                   autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`[B, T, R]` long: the expert indices `model` routes each token of `batch` (a `training.Batch`) to, -1 past
    each row's end; micro-batched by `token_budget`. The caller picks no-grad and the module's mode."""
    device = next(model.parameters()).device
    out = torch.full((*batch.input_ids_B_T.shape, routes_width(model)), -1, dtype=torch.long)
    start = 0
    with recording(model) as recorder:
        for micro in batch.micro_batches(token_budget):
            ids_B_T = micro.input_ids_B_T.to(device)
            cast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                    else contextlib.nullcontext())
            with cast:
                model(input_ids=ids_B_T, use_cache=False, logits_to_keep=1)
            routes_B_T_R = recorder.take().view(*ids_B_T.shape, -1)
            for b, length in enumerate(micro.lengths_B.tolist()):
                out[start + b, :length] = routes_B_T_R[b, :length]
            start += micro.size
    return out


def with_trainer_routes(samples: Sequence[Sample], backend, pad_id: int) -> list[Sample]:
    """The samples with `routes` set to the trainer's own routing now (router replay r2: one no-grad pass
    before the update, `backend.record_routes`)."""
    from tokenmill.training.batch import collate

    batch = collate(samples, [1.0] * len(samples), pad_id)
    routes_B_T_R = backend.record_routes(batch)
    out = list(samples)
    for row, i in enumerate(batch.sample_index_B.tolist()):
        s = samples[i]
        out[i] = s.with_(routes=routes_B_T_R[row, : len(s.tokens)].to(ROUTES_DTYPE))
    return out

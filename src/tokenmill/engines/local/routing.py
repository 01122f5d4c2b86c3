"""The expert choices of a mixture-of-experts model: which k experts each token was routed to, per layer.

A MoE layer's router scores every expert for a token and sends it to the top k. An engine and a trainer that
compute the same scores a little differently (bf16 against fp32, another batch shape, another kernel) can
pick different experts for the same token, and then their logprobs differ by far more than rounding. Router
replay records the engine's choices (`RoutingRecorder`) so that the trainer can route each token the same
way (`training.router_replay`).

A router here is a transformers top-k router module: `top_k`, `num_experts`, a `weight` and a forward that
returns `(router_logits, routing_weights, expert_indices)` (Qwen3-MoE's `Qwen3MoeTopKRouter` and the
routers of the families built like it). The `routes` of a sequence are an int16 tensor `[T, layers x top_k]`:
each token's expert indices, flattened layer by layer (flat rather than `[T, layers, top_k]` so that routers
with different `top_k` fit one row); -1 marks a token whose choice was not recorded (the trainer routes it
itself). int16 holds 32767 experts and the -1; a 30-layer, top-8 model's 1000-token completion is 480 KB.
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

ROUTES_DTYPE = torch.int16


def as_routes(routes: Any) -> torch.Tensor | None:
    """`routes` as the int16 `[T, R]` tensor `Completion.routes` and `Sample.routes` carry: a tensor, a numpy
    array or a sequence of per-token sequences (what older samples hold); None for None or empty."""
    if routes is None or len(routes) == 0:
        return None
    out = torch.as_tensor(routes if not isinstance(routes, tuple) else list(routes)).to(ROUTES_DTYPE)
    if out.dim() != 2:
        out = out.reshape(out.shape[0], -1)  # [T, layers, top_k] (vLLM's shape) -> [T, layers x top_k]
    return out


def fit_routes(read_T_R: torch.Tensor, length: int) -> torch.Tensor:
    """The routing of the tokens read, cut or padded with -1 rows (the last sampled token is never read) to
    the sequence's `length`."""
    out = torch.full((length, read_T_R.shape[-1]), -1, dtype=ROUTES_DTYPE)
    kept = min(length, read_T_R.shape[0])
    out[:kept] = read_T_R[:kept]
    return out


def prompt_routes(taken_N_R: torch.Tensor, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Each prompt's `[len, R]` routing out of a left-padded prefill's `[P x width, R]` (padding cut)."""
    width = max(len(p) for p in prompts)
    per_P_L_R = taken_N_R.view(len(prompts), width, taken_N_R.shape[-1])
    return [per_P_L_R[i, width - len(p):] for i, p in enumerate(prompts)]


def extend_routes(known_T_R: torch.Tensor | None, call_T_R: torch.Tensor) -> torch.Tensor:
    """A multi-turn episode's routing after one more engine call: the rows already recorded (by the calls that
    read those tokens first, where the sampling logprobs of those turns came from) kept, the rest (the last
    turn's final token, the observation, the new turn) taken from `call_T_R`, the routing of what this call
    read (its prompt is the episode so far)."""
    if known_T_R is None:
        return call_T_R
    unread = (known_T_R < 0).all(-1).nonzero()
    kept = int(unread[0]) if len(unread) else known_T_R.shape[0]
    return torch.cat([known_T_R[:kept], call_T_R[kept:]]).to(ROUTES_DTYPE)


def concat_routes(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Row chunks (a prompt's `[L, R]`, then one `[R]` or `[1, R]` per decode step) as one int16 `[T, R]`."""
    return torch.cat([p.reshape(-1, p.shape[-1]) for p in parts]).to(ROUTES_DTYPE)


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers in layer order (empty for a dense model)."""
    return [m for m in model.modules()
            if "Router" in type(m).__name__ and hasattr(m, "top_k") and hasattr(m, "num_experts")
            and isinstance(getattr(m, "weight", None), torch.nn.Parameter)]


def routes_width(model: torch.nn.Module) -> int:
    """Ints per token of `routes` (layers x top_k); 0 for a dense model."""
    return sum(int(r.top_k) for r in moe_routers(model))


class RoutingRecorder:
    """Forward hooks on every router that keep the expert indices of each forward call.

    After a forward over `N` tokens (any batch shape, flattened in row-major order), `take()` returns the
    `[N, layers x top_k]` indices of that call, layer by layer, and forgets them. `close()` removes the hooks.

        recorder = RoutingRecorder(model)
        model(input_ids=ids_B_T)
        routes_BT_R = recorder.take()     # [B * T, layers * top_k]
    """

    def __init__(self, model: torch.nn.Module, thread: threading.Thread | None = None) -> None:
        self.routers = moe_routers(model)
        # with a thread, only its forward calls are kept (a serving loop's, not a scorer's running beside it)
        self.thread = thread
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts router to record")
        self._pending: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.active = True  # False: the hooks keep nothing (a module shared with a trainer between rollouts)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, layer: int):
        def keep(module, inputs, output) -> None:
            if self.active and (self.thread is None or threading.current_thread() is self.thread):
                self._pending[layer].append(output[2].detach().to("cpu", ROUTES_DTYPE))

        return keep

    def take(self) -> torch.Tensor:
        """`[N, layers x top_k]` of the one forward call since the last `take`."""
        if any(len(p) != 1 for p in self._pending):
            calls = sorted({len(p) for p in self._pending})
            raise RuntimeError(f"routing: expected one router call per layer since the last take, got {calls}")
        out = torch.cat([p[0] for p in self._pending], dim=1)
        self._pending = [[] for _ in self.routers]
        return out

    def discard(self) -> None:
        self._pending = [[] for _ in self.routers]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


# ------------------------------------------------------------------------------------------ the wire form
def encode_routed_experts(routes_T_R: torch.Tensor, layers: int) -> str:
    """A completion's routing as vLLM's `routed_experts` answers it (`--enable-return-routed-experts`): base64 of
    the `.npy` of a `[tokens read, layers, top_k]` array, uint8 (uint16 past 255 experts); the tokens read are
    the prompt's and the completion's but the last sampled one, which no forward reads."""
    read = routes_T_R[: max(0, routes_T_R.shape[0] - 1)].to(torch.int32)
    dtype = np.uint8 if read.numel() == 0 or int(read.max()) < 256 else np.uint16
    array = read.reshape(read.shape[0], layers, -1).numpy().astype(dtype)
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_routed_experts(text: str, length: int) -> torch.Tensor:
    """`encode_routed_experts`'s answer (tokenmill serve's or vLLM's) as the int16 `[length, layers x top_k]` a
    `Completion` carries: rows past what the server read (the last sampled token) are -1."""
    array = np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)
    if array.ndim != 3:
        raise ValueError(f"routed_experts: expected a [tokens, layers, top_k] array, got shape {array.shape}")
    read = torch.from_numpy(array.astype(np.int32)).reshape(array.shape[0], -1)
    if read.shape[0] > length:
        raise ValueError(f"routed_experts: {read.shape[0]} tokens' routing for a sequence of {length} tokens")
    return fit_routes(read, length)

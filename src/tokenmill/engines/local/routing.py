"""The expert choices of a mixture-of-experts model: which k experts each token was routed to, per layer.

A MoE layer's router scores every expert for a token and sends it to the top k. An engine and a trainer that
compute the same scores a little differently (bf16 against fp32, another batch shape, another kernel) can
pick different experts for the same token, and then their logprobs differ by far more than rounding. Router
replay records the engine's choices (`RoutingRecorder`) so that the trainer can route each token the same
way (`training.router_replay`).

A router here is a transformers top-k router module: `top_k`, `num_experts`, a `weight` and a forward that
returns `(router_logits, routing_weights, expert_indices)` (Qwen3-MoE's `Qwen3MoeTopKRouter` and the
routers of the families built like it). `routes` of one token are its `layers x top_k` expert indices,
flattened layer by layer; -1 marks a token whose choice was not recorded (the trainer routes it itself).
"""

from __future__ import annotations

import torch


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

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts router to record")
        self._pending: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.active = True  # False: the hooks keep nothing (a module shared with a trainer between rollouts)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, layer: int):
        def keep(module, inputs, output) -> None:
            if self.active:
                    self._pending[layer].append(output[2].detach().to("cpu", torch.long))

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

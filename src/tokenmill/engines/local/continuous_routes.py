"""Router replay's recording in the continuously batched engine (`ContinuousEngine.record_routing`).

The loop thread owns the model, so the recorder keeps only that thread's forward calls (a `score` request
runs its forward beside the decode, from a server's worker thread). Each forward the loop makes is followed
by one `_advance` over the rows it served, in the forward's row order, so the routing is read there:

- a prefill (the rows were just admitted, no token sampled yet) read the distinct prompts of the admitted
  requests, left-padded, in order of first appearance: each row starts with its prompt's `[len, R]` routing;
- a decode step read one token per running row: each row appends its `[1, R]`.

A finished row's `Completion.routes` is its chunks joined and padded to prompt + completion with -1 (the last
sampled token is never read), the same int16 `[T, layers x top_k]` the in-process `HFEngine` returns.
"""

from __future__ import annotations

from typing import Any

from tokenmill.engines.local.routing import concat_routes, fit_routes, prompt_routes
from tokenmill.types import Completion


class RouteRecording:
    """Mixed into `ContinuousEngine` (before `HFEngine`): `record_routing` and the loop's three call sites."""

    _routing: Any
    _thread: Any

    def record_routing(self, on: bool = True) -> None:
        """Record a mixture-of-experts model's expert choice for every token the loop reads (`Completion.routes`),
        for router replay in a trainer (`tokenmill serve --enable-return-routed-experts`). As in `HFEngine`, it
        decodes with the transformers forward and without the prefix cache or the paged cache while it records."""
        super().record_routing(on)  # type: ignore[misc]
        if self._routing is not None:
            self._routing.thread = self._thread  # the loop's forwards only
            self._routing.active = True  # the engine owns its module: nothing else trains it

    @property
    def routing_layers(self) -> int:
        """Router layers of the routing it records (what `routed_experts` is shaped by); 0 when not recording."""
        return 0 if self._routing is None else len(self._routing.routers)

    def _record_routes(self, rows: list) -> None:
        """After a forward over `rows` (module docstring): give each row the routing of what it read."""
        if self._routing is None or not rows:
            return
        taken_N_R = self._routing.take()
        if rows[0].tokens:  # a decode step: one token per row
            for row, r_R in zip(rows, taken_N_R, strict=True):
                row.routes.append(r_R)
            return
        prompts = list(dict.fromkeys(tuple(row.request.prompt) for row in rows))  # `_admit`'s `unique`
        where = {p: i for i, p in enumerate(prompts)}
        read = prompt_routes(taken_N_R, prompts)
        for row in rows:
            row.routes.append(read[where[tuple(row.request.prompt)]])

    def _with_routes(self, row, completion: Completion) -> Completion:
        if not row.routes:
            return completion
        length = len(row.request.prompt) + len(completion.token_ids)
        return Completion(completion.token_ids, completion.logprobs, completion.stop_reason, completion.text,
                          routes=fit_routes(concat_routes(row.routes), length))

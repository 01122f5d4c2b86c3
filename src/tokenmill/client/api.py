"""The clients: `ServiceClient` -> `TrainingClient` (one LoRA adapter) and `SamplingClient`.

The same classes run in-process (`ServiceClient(base_model=...)`, a `TrainerService` in this process) or
against `tokenmill serve-trainer` (`ServiceClient(base_url=..., token=...)`); only the transport differs.
Calls are synchronous and return plain results (no futures).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.client.service import RequestError, TrainerService
from tokenmill.types import SamplingParams, TokenmillError

DEFAULT_ROOT = "runs/trainer"  # in-process saves, relative to the working directory (serve-trainer's --root too)


@dataclass(frozen=True)
class Datum:
    """One training sequence. Per-token lists are aligned with `tokens` (position t: token t given the ones
    before it; position 0 is never trained). `weights` default to 1 on every token but the first;
    `logprobs` are the sampler's (for the policy losses); `advantages` per token or one number."""

    tokens: list[int]
    weights: list[float] | None = None
    logprobs: list[float] | None = None
    advantages: list[float] | float = 0.0

    def wire(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping


@dataclass(frozen=True)
class SampledSequence:
    tokens: list[int]  # the completion's token ids
    logprobs: list[float]  # the sampler's logprob of each
    text: str
    stop_reason: str


@dataclass(frozen=True)
class SampleResult:
    prompt_ids: list[int]
    sequences: list[SampledSequence] = field(default_factory=list)


class InProcess:
    """Calls a `TrainerService` in this process (custom loss functions work here)."""

    def __init__(self, service: TrainerService) -> None:
        self.service = service

    def call(self, op: str, **kwargs: Any) -> dict[str, Any]:
        return getattr(self.service, op)(**kwargs)


class OverHttp:
    """Calls `tokenmill serve-trainer` at `base_url` (`POST /v1/<op>`, JSON, bearer token)."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 600.0) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)

    def call(self, op: str, **kwargs: Any) -> dict[str, Any]:
        if any(callable(v) for v in kwargs.values()):
            raise TokenmillError(f"{op}: a custom loss function runs in-process only; over HTTP name one")
        # NaN and inf travel as JSON's common extension, so the server names the field that holds one (400)
        body = json.dumps(kwargs, allow_nan=True).encode()
        reply = self.http.post(f"/v1/{op}", content=body, headers={"content-type": "application/json"})
        body = reply.json() if reply.headers.get("content-type", "").startswith("application/json") else {}
        if reply.status_code >= 400:
            err = body.get("error", {}) if isinstance(body, dict) else {}
            raise RequestError(err.get("message") or reply.text[:500], err.get("param"), reply.status_code)
        return body


class SamplingClient:
    def __init__(self, transport, sampler_id: str) -> None:
        self.transport, self.sampler_id = transport, sampler_id

    def sample(self, prompts: list[Any], params: SamplingParams | dict | None = None) -> list[SampleResult]:
        """`n` completions of each prompt (token ids, a string or chat messages)."""
        if isinstance(params, SamplingParams):
            params = {**dataclasses.asdict(params), "stop": list(params.stop)}
        got = self.transport.call("sample", sid=self.sampler_id, prompts=list(prompts), params=params)
        return [SampleResult(r["prompt_ids"], [SampledSequence(**s) for s in r["sequences"]])
                for r in got["samples"]]


class TrainingClient:
    """One LoRA adapter of the service's base model, with its own optimiser state and sampling RNG."""

    def __init__(self, transport, client_id: str, seed: int = 0) -> None:
        self.transport, self.client_id, self.seed = transport, client_id, seed

    def _call(self, op: str, **kwargs: Any) -> dict[str, Any]:
        return self.transport.call(op, cid=self.client_id, **kwargs)

    def forward_backward(self, data: list[Datum | dict], loss_fn: str | Callable = "cross_entropy",
                         loss_fn_config: dict | None = None) -> dict[str, float]:
        """Accumulate gradients of `loss_fn` over `data` (summed over tokens, weighted by `weights`): a name
        (`cross_entropy`, `importance_sampling`, `ppo`, or any of tokenmill's losses: `cispo`, `gspo`, ...),
        or, in-process, `fn(logprobs_B_T, batch) -> (loss, metrics)` on a `training.batch.Batch`."""
        return self._call("forward_backward", data=_wire(data), loss_fn=loss_fn,
                          loss_fn_config=loss_fn_config)["metrics"]

    def forward(self, data: list[Datum | dict]) -> list[list[float]]:
        """Each datum's token logprobs under the current weights (no gradient)."""
        return self._call("forward", data=_wire(data))["logprobs"]

    def optim_step(self, adam_params: AdamParams | dict | None = None) -> dict[str, float]:
        if isinstance(adam_params, AdamParams):
            adam_params = dataclasses.asdict(adam_params)
        return self._call("optim_step", adam_params=adam_params)["metrics"]

    def save_state(self, name: str) -> str:
        """Adapter weights and optimiser state under `name`; returns the path for `load_state`."""
        return self._call("save_state", name=name)["path"]

    def load_state(self, path: str) -> None:
        self._call("load_state", path=path)

    def save_weights_for_sampler(self, name: str) -> str:
        """The adapter as a peft folder; returns its path (for `ServiceClient.create_sampling_client`)."""
        return self._call("save_weights_for_sampler", name=name)["path"]

    def save_weights_and_get_sampling_client(self, seed: int | None = None) -> SamplingClient:
        """A sampler of the current weights (a snapshot: later steps do not change it)."""
        got = self.transport.call("create_sampling_client", client_id=self.client_id,
                                  seed=self.seed if seed is None else seed)
        return SamplingClient(self.transport, got["sampler_id"])


class ServiceClient:
    """In-process: `ServiceClient(base_model="path/to/model")`; over HTTP: `ServiceClient(base_url=..., token=...)`.

    In-process, `save_state` and `save_weights_for_sampler` write under `root` (default `runs/trainer` in the
    working directory, as `tokenmill serve-trainer`'s): `<root>/<client id>/states/<name>` and
    `<root>/<client id>/sampler_weights/<name>`; they stay there until removed (`self.root` names it)."""

    def __init__(self, base_model: str | None = None, *, base_url: str | None = None, token: str | None = None,
                 root: str | None = None, device: str = "cpu") -> None:
        if (base_model is None) == (base_url is None):
            raise TokenmillError("ServiceClient: give base_model (in-process) or base_url (a serve-trainer server)")
        self.root: Path | None = None  # where in-process saves go (a server's: its --root)
        if base_url is not None:
            self.transport: Any = OverHttp(base_url, token or os.environ.get("TOKENMILL_TRAINER_TOKEN"))
        else:
            service = TrainerService(base_model, root or DEFAULT_ROOT, device=device)
            self.root, self.transport = service.root, InProcess(service)

    def create_lora_training_client(self, rank: int = 8, *, alpha: float = 16.0, seed: int = 0,
                                    target_modules: Any = "all-linear") -> TrainingClient:
        got = self.transport.call("create_training_client", rank=rank, alpha=alpha, seed=seed,
                                  target_modules=target_modules)
        return TrainingClient(self.transport, got["client_id"], seed)

    def create_sampling_client(self, model_path: str, seed: int = 0) -> SamplingClient:
        got = self.transport.call("create_sampling_client", model_path=model_path, seed=seed)
        return SamplingClient(self.transport, got["sampler_id"])


def _wire(data: list[Datum | dict]) -> list[dict]:
    return [d.wire() if isinstance(d, Datum) else d for d in data]

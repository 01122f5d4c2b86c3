"""What a proxy run serves (`proxy:`): a copy of the policy in a continuous-batching engine behind the OpenAI
endpoint, the `EpisodeRecorder` that endpoint fills, and the agent program, if `proxy.agent_command` names one.

    >>> service = ProxyService(model, tokenizer, cfg.proxy, seed=0, max_tokens=64)   # doctest: +SKIP
    >>> agent = service.start_agent()   # plays at f"{service.url}/proxy/<episode id>/v1"  # doctest: +SKIP
    >>> service.update_weights(trainer_weights, version=1)                          # doctest: +SKIP
    >>> service.close()                                                             # doctest: +SKIP

The serving copy is the trainer's model deep-copied, so the agent keeps playing while the trainer trains; its
replies carry the version of the weights that produced them.
"""

from __future__ import annotations

import copy
import subprocess
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from tokenmill.engines.local.continuous import ContinuousEngine
from tokenmill.engines.server.app import create_app
from tokenmill.engines.server.recorder import EpisodeRecorder
from tokenmill.sandbox.lifetime import stop_process
from tokenmill.serving import check_exposure, start_in_thread
from tokenmill.serving_limits import ConnectionLimits
from tokenmill.types import TokenmillError

if TYPE_CHECKING:
    from tokenmill.config.schema import ProxyConfig


class ProxyService:
    """The proxy endpoint at `url` (`/proxy/<episode id>/v1`, `/v1/episodes/<episode id>/reward`) over a copy of
    `model` at policy `version`; `recorder` holds the episodes it served. A reply takes at most `max_tokens`
    (also the default); with `record_routes` the engine records a mixture-of-experts model's routing, kept with
    each recorded call (router replay r3). `close` stops the agent, the server and the engine."""

    def __init__(self, model: torch.nn.Module, tokenizer, cfg: ProxyConfig, *, seed: int, max_tokens: int,
                 version: int = 0, record_routes: bool = False) -> None:
        check_exposure(cfg.host, cfg.token, cfg.allow_remote, flag="proxy.allow_remote", token_flag="proxy.token")
        self.cfg, self.agent = cfg, None
        self.engine = ContinuousEngine(copy.deepcopy(model).eval(), tokenizer, seed=seed)
        self.engine.version = version
        if record_routes:
            self.engine.record_routing(True)
        self.recorder = EpisodeRecorder(ttl_s=cfg.episode_ttl_s, stepwise=cfg.stepwise)
        app = create_app(self.engine, model_name="policy", token=cfg.token, recorder=self.recorder,
                         default_max_tokens=max_tokens, max_tokens_cap=max_tokens)
        try:
            limits = ConnectionLimits(read_timeout_s=cfg.read_timeout_s, max_connections=cfg.max_connections)
            self.server, _ = start_in_thread(app, cfg.host, cfg.port, limits=limits)
        except BaseException:
            self.engine.close()
            raise
        self.url = self.server.url

    def start_agent(self) -> subprocess.Popen | None:
        """Start `proxy.agent_command` with `{url}` and `{token}` filled in (None when there is none)."""
        if not self.cfg.agent_command:
            return None
        argv = [a.replace("{url}", self.url).replace("{token}", self.cfg.token or "none")
                for a in self.cfg.agent_command]
        try:
            self.agent = subprocess.Popen(argv)
        except OSError as exc:
            self.close()
            raise TokenmillError(f"proxy.agent_command: cannot start {argv[0]!r}: {exc}") from None
        return self.agent

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """The serving copy takes version `version` (in-flight replies finish on the old weights)."""
        self.engine.update_weights(named_tensors, version=version)

    def close(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            stop_process(self.agent)
        self.server.stop()
        self.engine.close()

"""`ProxyFeed`: proxy mode's feed, the loop's `rollout` with the proxy collector over what a `ProxyService`
(`rollout/proxy_service.py`) serves."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tokenmill.controller.feeds.base import RolloutFn
from tokenmill.types import Group


class ProxyFeed:
    """Proxy mode: an external agent program plays against a copy of the policy served at
    `http://HOST:PORT/proxy/<episode id>/v1` and posts rewards; `get` runs the loop's `rollout` with the proxy
    collector, so dynamic sampling and overlong shaping apply as in any run.

    The serving copy lives in a continuous-batching engine: the agent keeps playing while the trainer trains,
    so its next episodes come from a policy at most a step old (each sample keeps the version it came from).
    """

    side = None  # one trainer side (the agent is not ours to label)

    def __init__(self, run, rollout: RolloutFn, start: int) -> None:
        from tokenmill.rollout.proxy import ProxyCollector
        from tokenmill.rollout.proxy_service import ProxyService

        cfg = run.cfg
        self.run, self.rollout = run, rollout
        self.service = ProxyService(run.trainer.model, run.tokenizer, cfg.proxy, seed=cfg.training.seed,
                                    max_tokens=cfg.generation.max_tokens, version=start,
                                    record_routes=cfg.training.router_replay == "r3")
        url = self.service.url
        run.logger.message(f"proxy endpoint: {url}/proxy/<episode id>/v1 (OpenAI API); post rewards "
                           f"to {url}/v1/episodes/<episode id>/reward")
        agent = self.service.start_agent()
        self.collector = ProxyCollector(self.service.recorder, cfg.generation.group_size, cfg.proxy.wait_timeout_s,
                                        agent)
        self.view = replace(run.rollout, actor=self.collector)  # the trainer's side, rolling out the agent's

    def get(self, step: int) -> tuple[list[Group], dict[str, float]] | None:
        groups, info = self.rollout(self.view, step)
        if not groups and self.collector.exhausted:
            self.run.logger.message(f"the agent exited; stopping after {step - 1} step(s)")
            return None
        lags = [step - 1 - s.version for g in groups for s in g.samples] or [0]
        return groups, info | {"proxy/version_lag_mean": sum(lags) / len(lags),
                               "proxy/version_lag_max": float(max(lags))}

    def push(self, step: int) -> None:
        """The serving copy and the trainer's own engine take version `step`."""
        self.service.update_weights(self.run.trainer.backend.weights(), version=step)
        self.run.rollout.engine.update_weights(self.run.trainer.backend.weights(), version=step)

    def state_dict(self) -> dict[str, Any]:
        return {"batches": []}  # episodes of incomplete groups are not kept: the agent plays on after a resume

    def close(self, finish: bool = False) -> None:
        self.service.close()

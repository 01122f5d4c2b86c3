"""Proxy-mode training: an external agent program plays; tokenmill serves it and trains on what it recorded.

The loop is the synchronous loop's with the generator replaced by the proxy endpoint: 1. collect finished
episodes until `prompts_per_step` groups of `group_size` are complete (episodes are grouped by the `group`
key the agent posts with the reward), 2. advantages, 3. policy update, 4. push the weights to the serving
engine (a copy of the policy in a continuous-batching engine: the agent keeps playing while we train, so its
next episodes come from a policy at most one step old; each sample keeps its version), 5. log.

The agent is any program that lets you set the OpenAI `base_url`; `proxy.agent_command` starts one for you
(and the run ends when it exits and its episodes are used up).
"""

from __future__ import annotations

import copy
import subprocess
import time
from typing import Any

from tokenmill.controller.build import Run
from tokenmill.controller.evaluate import rollout_metrics, sample_records
from tokenmill.controller.rl import advantages, held_out
from tokenmill.rollout.proxy import Episode, EpisodeRecorder, episodes_to_groups
from tokenmill.tracking.stages import stage, step_timer
from tokenmill.training.update import policy_update
from tokenmill.types import Group, TokenmillError


class ProxyError(TokenmillError):
    """The proxy run cannot go on (no episodes within the timeout); the message says what arrived."""


def run_proxy(run: Run) -> dict[str, Any]:
    """Serve `run`'s policy at the proxy endpoint and train on the agent's episodes until `controller.steps`."""
    from tokenmill.engines.continuous import ContinuousEngine
    from tokenmill.engines.server import create_app
    from tokenmill.envs.server import check_exposure, start_in_thread

    cfg, log, pc = run.cfg, run.logger, run.cfg.proxy
    check_exposure(pc.host, pc.token, pc.allow_remote)
    serving = ContinuousEngine(copy.deepcopy(run.model).eval(), run.tokenizer, seed=cfg.training.seed)
    recorder = EpisodeRecorder(ttl_s=pc.episode_ttl_s)
    app = create_app(serving, model_name="policy", token=pc.token, recorder=recorder,
                     default_max_tokens=cfg.generation.max_tokens, max_tokens_cap=cfg.generation.max_tokens)
    server, _ = start_in_thread(app, pc.host, pc.port)
    log.message(f"proxy endpoint: {server.url}/proxy/<episode id>/v1 (OpenAI API); post rewards to "
                f"{server.url}/v1/episodes/<episode id>/reward")
    agent = _start_agent(pc.agent_command, server.url, pc.token)
    result: dict[str, Any] = {}
    try:
        if run.eval_rows is not None:
            result["eval_before"] = held_out(run)
            log.log(0, result["eval_before"])
        result |= _train(run, serving, recorder, agent)
        if run.eval_rows is not None:
            result["eval_after"] = held_out(run)
            log.log(result["steps"], result["eval_after"])
    finally:
        if agent is not None and agent.poll() is None:
            agent.terminate()
            agent.wait(10)
        server.stop()
        serving.close()
    return result


def _train(run: Run, serving, recorder: EpisodeRecorder, agent: subprocess.Popen | None) -> dict[str, Any]:
    cfg, log = run.cfg, run.logger
    pending: dict[str, list[Episode]] = {}
    metrics: dict[str, Any] = {}
    step = 0
    for step in range(1, cfg.controller.steps + 1):
        with step_timer(step) as timer:
            # 1. the agent's finished episodes, as complete groups
            with stage("generate") as t:
                groups = _collect(run, recorder, pending, agent, first_group=0)
                t.add_tokens("generate", sum(sum(s.loss_mask) for g in groups for s in g.samples))
            if not groups:
                log.message(f"the agent exited; stopping after {step - 1} step(s)")
                step -= 1
                break
            # 2. advantages inside each group
            samples, train_metrics = advantages(run, groups)
            # 3. policy update
            if samples:
                with stage("train") as t:
                    train_metrics |= policy_update(
                        samples, run.backend, cfg.algorithm, pad_id=run.engine.pad_id,
                        max_tokens=cfg.generation.max_tokens, rng=run.update_rng, reference=run.reference,
                    )
                    t.add_tokens("train", sum(len(s.tokens) for s in samples))
            # 4. the serving copy gets the new weights (in-flight replies finish on the old ones)
            with stage("sync"):
                serving.update_weights(run.backend.weights(), version=step)
                run.engine.update_weights(run.backend.weights(), version=step)
        # 5. log
        metrics, errors = rollout_metrics(groups)
        lags = [step - 1 - s.version for g in groups for s in g.samples]
        metrics |= train_metrics | timer.report() | recorder.counts() | {
            "proxy/version_lag_mean": sum(lags) / len(lags), "proxy/version_lag_max": float(max(lags))}
        for e in errors:
            log.message(f"step {step}: {e}")
        log.log(step, metrics)
        log.log_samples(step, sample_records(groups, cfg.tracking.log_samples))
    return {"steps": step, "last_metrics": metrics}


def _collect(run: Run, recorder: EpisodeRecorder, pending: dict[str, list[Episode]],
             agent: subprocess.Popen | None, first_group: int) -> list[Group]:
    """Wait for `prompts_per_step` complete groups; [] once the agent has exited and nothing complete is left."""
    cfg = run.cfg
    want, size = cfg.controller.prompts_per_step, cfg.generation.group_size
    ready: list[list[Episode]] = []
    deadline = time.monotonic() + cfg.proxy.wait_timeout_s
    while len(ready) < want:
        for ep in recorder.take_finished(10_000, timeout_s=0.5):
            pending.setdefault(ep.group, []).append(ep)
            if len(pending[ep.group]) == size:
                ready.append(pending.pop(ep.group))
        if agent is not None and agent.poll() is not None and not recorder.counts()["finished"]:
            if agent.returncode != 0:
                raise ProxyError(f"proxy.agent_command exited with status {agent.returncode}")
            return [] if not ready else episodes_to_groups([e for g in ready for e in g], first_group)
        if time.monotonic() > deadline:
            raise ProxyError(
                f"proxy.wait_timeout_s: {len(ready)} of {want} complete groups of {size} episodes after "
                f"{cfg.proxy.wait_timeout_s:g} s ({sum(map(len, pending.values()))} episodes in incomplete groups; "
                f"{recorder.counts()['open']} open). Does the agent post rewards with a 'group' key?"
            )
    return episodes_to_groups([e for g in ready for e in g], first_group)


def _start_agent(command: list[str], url: str, token: str | None) -> subprocess.Popen | None:
    if not command:
        return None
    argv = [a.replace("{url}", url).replace("{token}", token or "none") for a in command]
    return subprocess.Popen(argv)

"""The weight-sync probe: after a push, the engine scores a fixed token sequence and must agree with the trainer.

A sync that did nothing (a file never reloaded, a broadcast into the void, an adapter never delivered) leaves
the engine sampling from old weights while the loop carries on; its logprobs then differ from the trainer's
by about one update's worth. The probe scores `probe_tokens` fixed token ids on the engine (`Scorer.score`,
on every server of a remote engine) and on the trainer's module (the same teacher-forced forward), and logs

    probe/max_abs   max over positions (and servers) of |logp_engine - logp_trainer|, temperature 1
    probe/ok        1.0 when probe/max_abs <= the tolerance, else 0.0
    probe/step      the push it checked, when it ran in the background (`WeightProbe`) and is logged later

The tolerance is `health.probe_tolerance`, or by the trainer's dtype (`DTYPE_TOLERANCE`): fp32 engines agree
to ~1e-6, half-precision ones only to their rounding (a bf16 logit carries 8 bits of mantissa).

Which engine is probed depends on the feed: the trainer's own engine (colocated: it shares the module, so the
check passes by construction), the servers of a process / remote placement, or proxy mode's
serving copy. (An engine whose `model` is the trainer's module object is not scored at all: both sides would
run the same forward on the same tensors, so its gap is 0 by construction.) A thread or worker placement's
engine copy takes its weights later (staged, applied by the producer between rollouts): it is not probed;
the per-step logprob mismatch (`mismatch/*`) shows whether its samples came from the trainer's weights. Nor is an fsdp2 run (its sharded module forwards only collectively).
"""

from __future__ import annotations

import math
import threading

import torch

DTYPE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 1e-1, torch.float16: 2e-2}


def probe_sequence(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """The fixed probe: `length` token ids drawn uniformly from [0, vocab_size) with a fixed seed (the same
    sequence every push, every run of the same model size)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def tolerance_for(dtype: torch.dtype, configured: float | None) -> float:
    return configured if configured is not None else DTYPE_TOLERANCE.get(dtype, 1e-1)


def probe_gap(engine, model: torch.nn.Module, sequence: list[int]) -> float:
    """max |engine - trainer| logprob over the probe's positions (and over the servers of a remote engine)."""
    return engine_gap(engine, trainer_logprobs(model, sequence), sequence)


def trainer_logprobs(model: torch.nn.Module, sequence: list[int]) -> torch.Tensor:
    """The trainer's side of the probe: its module's teacher-forced logprobs of `sequence` (float64)."""
    from tokenmill.engines.local.scoring import score_sequences

    was_training = model.training
    model.eval()
    try:
        [(trainer, _)] = score_sequences(model, [sequence])
    finally:
        model.train(was_training)
    return torch.tensor(trainer.token_logprobs, dtype=torch.float64)


def engine_gap(engine, want: torch.Tensor, sequence: list[int], version: int | None = None) -> float:
    """The engine's side against `want`. With `version` (the push being checked), a server that says it
    scored with newer weights is left out: a later push landed first, and the next probe checks it. One that
    says older is compared (its push did not land: a server applies staged weights before it scores)."""
    each = getattr(engine, "score_each", None)  # a remote engine: every live server must have the weights
    scores = [s[0] for s in each([sequence]).values()] if each is not None else engine.score([sequence])
    if version is not None:
        scores = [s for s in scores if s.policy_version is None or s.policy_version <= version]
    gaps = [float((torch.tensor(s.token_logprobs, dtype=torch.float64) - want).abs().max()) for s in scores]
    return max(gaps, default=float("nan"))  # no server answered: failover's alarm, the probe says nothing


def probed_engine(feed, run):
    """The engine a push reaches and the probe can score, or (None, the reason it is not probed)."""
    feed = getattr(feed, "feed", feed)  # a recording feed wraps the real one
    if run.cfg.training.backend == "fsdp2":
        return None, "fsdp2 shards the module: the engine shares it on each rank"
    serving = getattr(feed, "serving", None)  # proxy mode's serving copy
    if serving is not None:
        return serving, ""
    placement = getattr(feed, "placement", None)
    if placement is not None:
        if getattr(placement, "urls", None) is None:
            return None, "a thread or worker placement applies staged weights later, between rollouts"
        return placement.engine, ""
    return run.rollout.engine, ""


class WeightProbe:
    """`after_push(step)` every `health.probe_every`-th push: the `probe/*` metrics of that step ({} otherwise).

    Beside a producer that runs ahead (`controller.max_staleness` >= 1) on tokenmill's own servers (the process
    placement, Ray's fleet), the engine's side runs in a thread: a server scores only once its running
    requests have finished and the pushed weights are in, and the trainer must not wait for that. The trainer's
    side is computed at the push; the result is reported by the first `after_push` after it comes, with
    `probe/step`, the push it checked.
    """

    def __init__(self, run, feed, say=print) -> None:
        health = run.cfg.health
        self.every, self.model = health.probe_every, run.trainer.model
        self.engine, reason = probed_engine(feed, run) if self.every else (None, "")
        if self.engine is not None and not hasattr(self.engine, "score"):
            self.engine, reason = None, f"{type(self.engine).__name__} cannot score sequences"
        if self.every and self.engine is None:
            say(f"health: the weight-sync probe is off ({reason})")
        dtype = next(self.model.parameters()).dtype
        vocab = self.model.get_input_embeddings().weight.shape[0]
        self.tolerance = tolerance_for(dtype, health.probe_tolerance)
        self.sequence = probe_sequence(vocab, health.probe_tokens)
        self.pushes = 0
        # in the background: a producer runs ahead of the pushes, on tokenmill's servers, which stage a push and
        # say which version scored (another server's later score cannot be told from one of the pushed weights)
        placement = getattr(getattr(feed, "feed", feed), "placement", None)
        self.background = (self.engine is not None and getattr(placement, "ours", False)
                           and run.cfg.controller.max_staleness > 0)
        self._pending: tuple[int, threading.Thread, list] | None = None

    def after_push(self, step: int) -> dict[str, float]:
        self.pushes += 1
        done = self._collect() if self.background else {}
        if self.engine is None or self.pushes % self.every:
            return done
        if getattr(self.engine, "model", None) is self.model:  # the engine samples from the trainer's own module:
            return {"probe/max_abs": 0.0, "probe/ok": 1.0}  # the same forward on the same weights, no need to run it
        if not self.background:
            return self._metrics(probe_gap(self.engine, self.model, self.sequence))
        if self._pending is None:  # one probe at a time; a push made while one runs is checked by the next
            want, out = trainer_logprobs(self.model, self.sequence), []
            thread = threading.Thread(target=self._score, args=(want, step, out), daemon=True,
                                      name="tokenmill-probe")
            thread.start()
            self._pending = (step, thread, out)
        return done

    def _score(self, want: torch.Tensor, step: int, out: list) -> None:
        try:
            out.append(engine_gap(self.engine, want, self.sequence, version=step))
        except Exception:  # noqa: BLE001 - a server that fails to answer is failover's business, not the probe's
            out.append(float("nan"))

    def _collect(self) -> dict[str, float]:
        if self._pending is None or self._pending[1].is_alive():
            return {}
        step, _, out = self._pending
        self._pending = None
        metrics = self._metrics(out[0] if out else float("nan"))
        return metrics | {"probe/step": float(step)} if metrics else {}

    def _metrics(self, gap: float) -> dict[str, float]:
        if math.isnan(gap):  # no live server to probe
            return {}
        return {"probe/max_abs": gap, "probe/ok": float(gap <= self.tolerance)}

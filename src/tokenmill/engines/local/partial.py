"""Partial rollouts for the in-process (thread) placement: in-flight generations continue with new weights.

`HFEngine.generate` runs a batch to the end, so the wrapper generates `chunk` tokens at a time. Between
chunks it lets the placement load any weights the trainer staged; the unfinished completions are then
re-submitted as prompt + tokens so far and continue under the new policy. Every token records the policy
version that sampled it, and the sample's `version` is its oldest token's (what the staleness bound checks).
Logprobs stay the sampler's own per token, so the off-policy correction sees the true behaviour policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tokenmill.types import Completion, Group, SamplingParams, StopReason


@dataclass
class _Seq:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reason: StopReason | None = None


class PartialRolloutEngine:
    """Wraps an `HFEngine`; `placement.apply_pending()` is called between chunks of `chunk` tokens."""

    def __init__(self, engine, chunk: int, placement) -> None:
        self.engine, self.chunk, self.placement = engine, chunk, placement
        self.token_versions: dict[tuple[int, ...], tuple[int, ...]] = {}  # prompt + completion -> versions
        self.interrupted = 0  # completions that crossed a weight update

    def __getattr__(self, name: str):  # version, pad_id, generator, tokenizer, ... are the engine's
        return getattr(self.engine, name)

    def update_weights(self, named_tensors, version: int) -> None:
        self.engine.update_weights(named_tensors, version)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        n = params.n
        seqs = [_Seq(list(p)) for p in prompts for _ in range(n)]
        first = self.engine.generate(prompts, replace(params, max_tokens=min(self.chunk, params.max_tokens)))
        self._extend(seqs, [c for group in first for c in group], params)
        while True:
            live = [s for s in seqs if s.reason is None]
            if not live:
                break
            if self.placement.apply_pending():
                self.interrupted += len(live)
            budget = min(self.chunk, params.max_tokens - len(live[0].tokens))
            more = self.engine.generate([s.prompt + s.tokens for s in live],
                                        replace(params, n=1, max_tokens=budget))
            self._extend(live, [group[0] for group in more], params)
        out = [self._completion(s, params) for s in seqs]
        return [out[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _extend(self, seqs: list[_Seq], completions: list[Completion], params: SamplingParams) -> None:
        """Append one chunk to each sequence; a sequence ends at EOS / a stop string or at max_tokens (all live
        sequences have the same length, since each chunk runs to its budget unless it stops)."""
        version = self.engine.version
        for s, c in zip(seqs, completions, strict=True):
            s.tokens += c.token_ids
            s.logprobs += c.logprobs
            s.versions += [version] * len(c.token_ids)
            if c.stop_reason is StopReason.STOP or self._hit_stop(s, params):
                s.reason = StopReason.STOP
            elif len(s.tokens) >= params.max_tokens:
                s.reason = StopReason.LENGTH

    def _hit_stop(self, s: _Seq, params: SamplingParams) -> bool:
        """A stop string that spans two chunks is found in the whole completion's text."""
        if not params.stop:
            return False
        text = self.engine.tokenizer.decode(s.tokens, skip_special_tokens=True)
        return any(stop in text for stop in params.stop)

    def _completion(self, s: _Seq, params: SamplingParams) -> Completion:
        text = self.engine.tokenizer.decode(s.tokens, skip_special_tokens=True)
        for stop in params.stop:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        self.token_versions[tuple(s.prompt + s.tokens)] = tuple(s.versions)
        return Completion(tuple(s.tokens), tuple(s.logprobs), s.reason or StopReason.LENGTH, text)

    def stamp(self, groups: list[Group]) -> list[Group]:
        """Give each sample its tokens' versions (and the oldest as its version); forget the batch."""
        out = []
        for g in groups:
            samples = []
            for s in g.samples:
                versions = self.token_versions.get(tuple(s.tokens))
                if versions:
                    s = s.with_(version=min(versions), token_versions=versions)
                samples.append(s)
            out.append(Group(g.group_id, tuple(samples)))
        self.token_versions.clear()
        return out

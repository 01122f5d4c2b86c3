"""An in-process engine that keeps each prompt it was given and what it returned, for tests that check the
exact token ids an agent loop sent to the model call by call."""

from __future__ import annotations

from tokenmill.engines.local.hf import HFEngine


class LoggedEngine(HFEngine):
    """The real engine; `calls` (set it to a list) gets `(prompt ids, first completion)` per prompt."""

    calls: list

    def generate(self, prompts, params):
        out = super().generate(prompts, params)
        self.calls += [(tuple(p), group[0]) for p, group in zip(prompts, out, strict=True)]
        return out

"""The rollout protocol: what plays the policy and turns one step's rows into scored groups.

Three implementations ship, and the loop calls them the same way:

- `Generator` (`rollout/generator.py`): single-turn; one engine batch for all rows, then the rewards.
- `AgentLoop` (`rollout/agent.py`): multi-turn episodes against environments; the returns are the rewards.
- `ProxyCollector` (`rollout/proxy.py`): an external agent program plays through the OpenAI endpoint; the
  episodes it finished and rewarded are grouped (`len(rows)` groups; the rows themselves are not used).

    >>> groups, info = generator.rollout(rows, version=engine.version, first_group=0)   # doctest: +SKIP
    >>> [len(g.samples) for g in groups] == [params.n] * len(rows)                       # doctest: +SKIP
    True

Each implementation times its own stages (`generate`, and `reward` where scoring is separate) and reports
the tokens it generated, so the loop's timing and throughput read the same for all three.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from tokenmill.types import Group


@runtime_checkable
class Rollout(Protocol):
    """Turns rows into groups of scored samples: one group per row, `group_id`s from `first_group` on."""

    def rollout(
        self, rows: Sequence[dict[str, Any]], version: int, first_group: int = 0
    ) -> tuple[list[Group], dict[str, float]]:
        """The groups (each sample stamped with policy `version`) and metrics of producing them."""
        ...

"""`Batch`: the only place where samples become padded tensors.

Sequences are sorted by length and right-padded, so a micro-batch is a contiguous row slice trimmed to its
own longest sequence (length bucketing: little padding, no cross-sequence attention masks). With right
padding, causal attention never lets a real token see a pad, so no attention mask is needed at all.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace

import torch

from tokenmill.types import Sample


@dataclass(frozen=True)
class Batch:
    """Right-padded, length-sorted tensors; per-token tensors are aligned with `input_ids_B_T`."""

    input_ids_B_T: torch.Tensor  # long
    lengths_B: torch.Tensor  # long, real tokens per row (descending)
    weights_B_T: torch.Tensor  # float: loss mask x aggregation weight (see algorithms.aggregation)
    old_logprobs_B_T: torch.Tensor  # float: sampler logprobs (0 where not trained)
    advantages_B: torch.Tensor  # float
    ref_logprobs_B_T: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.input_ids_B_T.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.lengths_B.sum())

    def to(self, device: torch.device | str) -> Batch:
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def slice(self, start: int, stop: int) -> Batch:
        """Rows [start, stop) trimmed to their longest sequence."""
        width = int(self.lengths_B[start:stop].max())
        cut = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value[start:stop]
                if value.dim() == 2:
                    value = value[:, :width]
            cut[f.name] = value
        return Batch(**cut)

    def micro_batches(self, token_budget: int) -> Iterator[Batch]:
        """Consecutive slices whose padded size (rows x longest row) stays within `token_budget`."""
        start, lengths = 0, self.lengths_B.tolist()
        while start < len(lengths):
            width, stop = lengths[start], start + 1  # rows are sorted longest first
            while stop < len(lengths) and (stop + 1 - start) * width <= token_budget:
                stop += 1
            yield self.slice(start, stop)
            start = stop


def collate(samples: Sequence[Sample], weights: Sequence[float], pad_id: int) -> Batch:
    """Pad `samples` into a `Batch`; `weights[i]` multiplies sample i's loss mask."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].tokens))
    width = len(samples[order[0]].tokens)
    b = len(samples)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    w = torch.zeros((b, width), dtype=torch.float32)
    old = torch.zeros((b, width), dtype=torch.float32)
    lengths, adv = [], []
    for row, i in enumerate(order):
        s = samples[i]
        n = len(s.tokens)
        ids[row, :n] = torch.tensor(s.tokens, dtype=torch.long)
        w[row, :n] = torch.tensor(s.loss_mask, dtype=torch.float32) * weights[i]
        old[row, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
        lengths.append(n)
        adv.append(s.advantage)
    return Batch(
        input_ids_B_T=ids,
        lengths_B=torch.tensor(lengths, dtype=torch.long),
        weights_B_T=w,
        old_logprobs_B_T=old,
        advantages_B=torch.tensor(adv, dtype=torch.float32),
    )

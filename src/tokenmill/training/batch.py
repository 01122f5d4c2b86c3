"""`Batch`: the only place where samples become padded tensors.

Sequences are sorted by length and right-padded, so a micro-batch is a contiguous row slice trimmed to its
own longest sequence (length bucketing: little padding, no cross-sequence attention masks). With right
padding, causal attention never lets a real token see a pad, so no attention mask is needed at all.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace

import torch

from tokenmill.training.router_replay import routes_tensor
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
    prompt_lens_B: torch.Tensor | None = None  # long: leading tokens shared by a group (see training.packing)
    sample_index_B: torch.Tensor | None = None  # long: which of the collated samples each row holds
    advantages_B_T: torch.Tensor | None = None  # float: per-token advantages (GAE); overrides advantages_B
    returns_B_T: torch.Tensor | None = None  # float: the critic's regression targets (GAE)
    old_values_B_T: torch.Tensor | None = None  # float: the critic's values at rollout time (value clipping)
    # float: the sampler's logprobs when old_logprobs_B_T holds the trainer's recomputed ones (off-policy
    # correction, algorithm.off_policy); None otherwise
    behaviour_logprobs_B_T: torch.Tensor | None = None
    # long: a mixture-of-experts policy's recorded expert indices per token (layers x top_k, -1 where not
    # recorded), replayed by the trainer (`training.router_replay`); None when no sample carries any
    routes_B_T_R: torch.Tensor | None = None
    # each row's prompt images (`types.ImageInputs`, None for a text-only row) when some sample has images: a
    # vision-language policy's batch (`training.vision`); None otherwise
    images_B: tuple | None = None

    @property
    def advantages(self) -> torch.Tensor:
        """What the policy loss multiplies: per token `[B, T]` where GAE set them, else per sequence `[B]`."""
        return self.advantages_B if self.advantages_B_T is None else self.advantages_B_T

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
        return self.select(range(start, stop))

    def select(self, rows: Sequence[int]) -> Batch:
        """The given rows, in that order, trimmed to their longest sequence."""
        index = torch.tensor(list(rows), dtype=torch.long)
        width = int(self.lengths_B[index].max())
        cut = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value[index]
                if value.dim() >= 2:
                    value = value[:, :width]
            elif isinstance(value, tuple):  # per-row objects (images)
                value = tuple(value[i] for i in rows)
            cut[f.name] = value
        return Batch(**cut)

    def micro_batches(self, token_budget: int) -> Iterator[Batch]:
        """Consecutive slices whose padded size (rows x longest row) stays within `token_budget`."""
        for start, stop in greedy_spans(self.lengths_B.tolist(), token_budget):  # rows are sorted longest first
            yield self.slice(start, stop)


def greedy_spans(widths: Sequence[int], token_budget: int) -> list[tuple[int, int]]:
    """Consecutive `[start, stop)` runs of `widths` (widest first), each as long as its padded size, rows x
    its first width, stays within `token_budget` (a row wider than the budget runs alone): how every
    micro-batch loop sizes its micro-batches (`Batch.micro_batches`, `packing.micro_packs`)."""
    spans, start = [], 0
    while start < len(widths):
        stop = start + 1
        while stop < len(widths) and (stop + 1 - start) * widths[start] <= token_budget:
            stop += 1
        spans.append((start, stop))
        start = stop
    return spans


def collate(samples: Sequence[Sample], weights: Sequence[float], pad_id: int) -> Batch:
    """Pad `samples` into a `Batch`; `weights[i]` multiplies sample i's loss mask."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].tokens))
    width = len(samples[order[0]].tokens)
    ids, w, old = [], [], []
    for i in order:  # built as lists, turned into tensors once (per-row tensors cost more than the rows)
        s, pad = samples[i], width - len(samples[i].tokens)
        ids.append([*s.tokens, *([pad_id] * pad)])
        w.append([m * weights[i] for m in s.loss_mask] + [0.0] * pad)
        old.append([*s.logprobs, *([0.0] * pad)])
    picked = [samples[i] for i in order]
    per_token = {}
    if all(s.token_advantages for s in picked):  # PPO with a critic: GAE gave every token its own values
        for name, attr in (("advantages_B_T", "token_advantages"), ("returns_B_T", "returns"),
                           ("old_values_B_T", "values")):
            rows = [[*getattr(s, attr), *([0.0] * (width - len(s.tokens)))] for s in picked]
            per_token[name] = torch.tensor(rows, dtype=torch.float32)
    return Batch(
        input_ids_B_T=torch.tensor(ids, dtype=torch.long),
        lengths_B=torch.tensor([len(s.tokens) for s in picked], dtype=torch.long),
        weights_B_T=torch.tensor(w, dtype=torch.float32),
        old_logprobs_B_T=torch.tensor(old, dtype=torch.float32),
        advantages_B=torch.tensor([s.advantage for s in picked], dtype=torch.float32),
        prompt_lens_B=torch.tensor([s.prompt_len for s in picked], dtype=torch.long),
        sample_index_B=torch.tensor(order, dtype=torch.long),
        routes_B_T_R=routes_tensor(picked, width),
        images_B=tuple(s.images for s in picked) if any(s.images is not None for s in picked) else None,
        **per_token,
    )

"""Rollout dumps: every step's scored groups as Parquet shards, and the groups read back for a replay.

One row per sample, in the order the loop got them (a step's groups, each group's samples):

| column | what |
|---|---|
| `step`, `group_id`, `index` | the training step, the group and the sample's place in it |
| `prompt_ids`, `completion_ids` | token ids (`tokens` = prompt_ids + completion_ids) |
| `loss_mask`, `logprobs` | aligned with all the tokens (float64: the sampler's logprobs exactly) |
| `token_versions` | per completion token when a completion spans weight updates (else empty) |
| `version`, `reward`, `stop_reason`, `completion` | as in `tokenmill.types.Sample` |
| `rewards`, `reward_errors`, `prompt`, `row` | JSON text: per-function rewards, errors, the prompt (a string or chat messages), the dataset row |

A shard holds `record.every` steps and is named by its first and last step (`steps_00000001-00000010.parquet`);
it is written to a temporary name and renamed, so a folder never holds half a shard. `datasets` reads a dump:
`load_dataset("parquet", data_files=f"{folder}/*.parquet")`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from tokenmill.types import Group, Sample, StopReason, TokenmillError

SHARD_GLOB = "steps_*.parquet"


def features():
    """The dump's schema (explicit, so that shards with and without optional columns read as one dataset)."""
    from datasets import Features, Sequence, Value

    ints, floats = Sequence(Value("int32")), Sequence(Value("float64"))
    return Features({
        "step": Value("int64"), "group_id": Value("int64"), "index": Value("int32"),
        "prompt_ids": ints, "completion_ids": ints, "loss_mask": Sequence(Value("int8")), "logprobs": floats,
        "token_versions": Sequence(Value("int64")), "version": Value("int64"), "reward": Value("float64"),
        "stop_reason": Value("string"), "completion": Value("string"), "rewards": Value("string"),
        "reward_errors": Value("string"), "prompt": Value("string"), "row": Value("string"),
    })


def sample_row(step: int, group_id: int, index: int, s: Sample) -> dict[str, Any]:
    return {
        "step": step, "group_id": group_id, "index": index,
        "prompt_ids": list(s.tokens[: s.prompt_len]), "completion_ids": list(s.tokens[s.prompt_len :]),
        "loss_mask": list(s.loss_mask), "logprobs": [float(x) for x in s.logprobs],
        "token_versions": list(s.token_versions), "version": s.version, "reward": float(s.reward),
        "stop_reason": s.stop_reason.value, "completion": s.completion,
        "rewards": json.dumps(s.rewards), "reward_errors": json.dumps(s.reward_errors),
        "prompt": json.dumps(s.prompt, default=str), "row": json.dumps(s.row, default=str),
    }


def row_sample(r: dict[str, Any]) -> Sample:
    prompt_ids, completion_ids = r["prompt_ids"], r["completion_ids"]
    return Sample(
        tokens=tuple(prompt_ids) + tuple(completion_ids), loss_mask=tuple(r["loss_mask"]),
        logprobs=tuple(r["logprobs"]), prompt_len=len(prompt_ids), prompt=json.loads(r["prompt"]),
        completion=r["completion"], stop_reason=StopReason(r["stop_reason"]), version=r["version"],
        group_id=r["group_id"], reward=r["reward"] if r["reward"] is not None else math.nan,
        rewards=json.loads(r["rewards"]), reward_errors=json.loads(r["reward_errors"]), row=json.loads(r["row"]),
        token_versions=tuple(r["token_versions"]),
    )


class RolloutRecorder:
    """Collects steps' groups and writes a shard every `every` steps (and the rest on `flush`)."""

    def __init__(self, folder: str | Path, every: int = 10) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.every = every
        self.rows: list[dict[str, Any]] = []
        self.steps: list[int] = []
        self.written: list[Path] = []

    def add(self, step: int, groups: list[Group]) -> None:
        self.rows += [sample_row(step, g.group_id, i, s) for g in groups for i, s in enumerate(g.samples)]
        self.steps.append(step)
        if len(self.steps) >= self.every:
            self.flush()

    def flush(self) -> Path | None:
        """Write what is held as one shard (atomically); None when nothing is."""
        if not self.rows:  # steps without a group (nothing to train): a replay gives them none either
            self.steps = []
            return None
        import pyarrow.parquet as pq
        from datasets import Dataset

        path = self.folder / f"steps_{self.steps[0]:08d}-{self.steps[-1]:08d}.parquet"
        tmp = path.with_name(f".{path.name}.tmp")
        # the table `datasets` builds (its features in the schema's metadata), written without a progress bar
        pq.write_table(Dataset.from_list(self.rows, features=features()).data.table, str(tmp))
        os.replace(tmp, path)
        self.rows, self.steps = [], []
        self.written.append(path)
        return path


def shards(folder: str | Path) -> list[Path]:
    found = sorted(Path(folder).glob(SHARD_GLOB))
    if not found:
        raise TokenmillError(f"record.replay: no rollout shards ({SHARD_GLOB}) in {str(folder)!r}")
    return found


def read_dump(folder: str | Path) -> dict[int, list[Group]]:
    """Every step's groups in a dump folder, as the loop got them (samples and groups in order). A step that
    two shards hold (a resumed run recorded it again) is taken from the newer shard."""
    import pyarrow.parquet as pq

    steps: dict[int, list[Group]] = {}
    for path in sorted(shards(folder), key=lambda p: (p.stat().st_mtime_ns, p.name)):
        current: dict[tuple[int, int], list[Sample]] = {}
        for r in pq.read_table(path).to_pylist():
            current.setdefault((r["step"], r["group_id"]), []).append(row_sample(r))
        mine: dict[int, list[Group]] = {}
        for (step, group_id), samples in current.items():
            mine.setdefault(step, []).append(Group(group_id, tuple(samples)))
        steps |= mine
    return steps


class ReplayEngine:
    """Stands where a run's engine would be during a replay: it has the trainer's pad id and a policy version,
    and refuses to generate (a replay trains on recorded rollouts only)."""

    def __init__(self, model, tokenizer) -> None:
        eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
        eos_ids = {e for e in [*(eos if isinstance(eos, list) else [eos]), tokenizer.eos_token_id] if e is not None}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)  # as HFEngine
        self.version = 0

    def generate(self, prompts, params):
        raise TokenmillError("record.replay: a replay has no engine; it trains on the recorded rollouts only")

    def update_weights(self, named_tensors, version: int) -> None:
        self.version = version

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass

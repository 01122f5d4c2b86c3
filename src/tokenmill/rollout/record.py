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

Beside the shards, `recording.json` (`MANIFEST`) holds what the recording depends on (the run's fingerprint,
`checkpoint.recording.run_fingerprint`), the last step recorded and the step ranges that had no groups (and so
no shard). `read_dump` refuses a recording with a gap (a step range no shard and no empty range covers, up to
the last step recorded) or an unreadable shard, in one line naming the steps or the file.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from tokenmill.types import Group, Sample, StopReason, TokenmillError

SHARD_GLOB = "steps_*.parquet"
SHARD_NAME = re.compile(r"^steps_(\d+)-(\d+)\.parquet$")
MANIFEST = "recording.json"


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

    def __init__(self, folder: str | Path, every: int = 10, fingerprint: dict[str, Any] | None = None) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.every = every
        self.rows: list[dict[str, Any]] = []
        self.steps: list[int] = []
        self.written: list[Path] = []
        self.manifest = read_manifest(self.folder)  # a resumed run goes on with its recording's
        if fingerprint is not None:
            self.manifest["fingerprint"] = fingerprint
        self._write_manifest()

    def _write_manifest(self) -> None:
        tmp = self.folder / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(self.manifest, indent=1, default=str))
        os.replace(tmp, self.folder / MANIFEST)

    def add(self, step: int, groups: list[Group]) -> None:
        self.rows += [sample_row(step, g.group_id, i, s) for g in groups for i, s in enumerate(g.samples)]
        self.steps.append(step)
        if len(self.steps) >= self.every:
            self.flush()

    def flush(self) -> Path | None:
        """Write what is held as one shard (atomically); None when nothing is."""
        if not self.steps:
            return None
        first, last = self.steps[0], self.steps[-1]
        self.manifest["last_step"] = max(last, self.manifest.get("last_step", 0))
        if not self.rows:  # steps without a group (nothing to train): a replay gives them none either
            self.manifest.setdefault("empty_steps", []).append([first, last])
            self.steps = []
            self._write_manifest()
            return None
        import pyarrow.parquet as pq
        from datasets import Dataset

        path = self.folder / f"steps_{first:08d}-{last:08d}.parquet"
        tmp = path.with_name(f".{path.name}.tmp")
        # the table `datasets` builds (its features in the schema's metadata), written without a progress bar
        pq.write_table(Dataset.from_list(self.rows, features=features()).data.table, str(tmp))
        os.replace(tmp, path)
        self.rows, self.steps = [], []
        self.written.append(path)
        self._write_manifest()  # after the shard: a manifest never names a step no shard holds
        return path


def shards(folder: str | Path) -> list[Path]:
    found = sorted(Path(folder).glob(SHARD_GLOB))
    if not found:
        raise TokenmillError(f"record.replay: no rollout shards ({SHARD_GLOB}) in {str(folder)!r}")
    return found


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """A recording's `recording.json` ({} for one recorded before it existed)."""
    path = Path(folder) / MANIFEST
    try:
        found = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise TokenmillError(f"record.replay: {str(path)!r} is unreadable ({exc}); restore it or record again") from None
    return found if isinstance(found, dict) else {}


def step_range(path: Path) -> tuple[int, int]:
    match = SHARD_NAME.match(path.name)
    if match is None:
        raise TokenmillError(f"record.replay: {path.name!r} is not a shard name (steps_<first>-<last>.parquet); "
                             "move it out of the recording")
    return int(match[1]), int(match[2])


def missing_steps(found: list[Path], manifest: dict[str, Any]) -> list[tuple[int, int]]:
    """The step ranges, from the first step recorded to the last, that no shard and no empty range covers."""
    ranges = [step_range(p) for p in found] + [tuple(r) for r in manifest.get("empty_steps", [])]
    last = max([b for _, b in ranges] + [int(manifest.get("last_step", 0))])
    covered = sorted(ranges)
    gaps, next_step = [], covered[0][0]
    for a, b in covered:
        if a > next_step:
            gaps.append((next_step, a - 1))
        next_step = max(next_step, b + 1)
    if next_step <= last:
        gaps.append((next_step, last))
    return gaps


def _steps(ranges: list[tuple[int, int]]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


def read_shard(path: Path) -> list[dict[str, Any]]:
    """A shard's rows; a truncated or corrupt one is refused in one line naming it and its steps."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        first, last = step_range(path)
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TokenmillError(f"record.replay: shard {str(path)!r} (steps {_steps([(first, last)])}) is unreadable, "
                             f"truncated or corrupt ({why}); restore it or record again") from None


def read_dump(folder: str | Path) -> dict[int, list[Group]]:
    """Every step's groups in a dump folder, as the loop got them (samples and groups in order). A step that
    two shards hold (a resumed run recorded it again) is taken from the newer shard. A gap in the recording
    (a missing shard) or an unreadable shard is refused."""
    found = shards(folder)
    gaps = missing_steps(found, read_manifest(folder))
    if gaps:
        raise TokenmillError(f"record.replay: the recording in {str(folder)!r} misses steps {_steps(gaps)} (no shard "
                             "holds them); a replay would train those steps on nothing: restore the shards or "
                             "replay a complete recording")
    steps: dict[int, list[Group]] = {}
    for path in sorted(found, key=lambda p: (p.stat().st_mtime_ns, p.name)):
        current: dict[tuple[int, int], list[Sample]] = {}
        for r in read_shard(path):
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

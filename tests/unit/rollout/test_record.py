"""The rollout dump: samples round-trip exactly (logprobs to the last bit), shards are whole, and
`datasets.load_dataset("parquet", ...)` opens a dump folder."""

from __future__ import annotations

import math

import pytest
from datasets import load_dataset

from tokenmill.rollout.record import RolloutRecorder, read_dump
from tokenmill.types import Group, Sample, StopReason, TokenmillError


def _sample(i: int, group: int, version: int) -> Sample:
    n = 3 + i
    return Sample(
        tokens=tuple(range(10 + i, 10 + i + n)), loss_mask=(0, 0) + (1,) * (n - 2),
        logprobs=(0.0, 0.0) + tuple(-1 / (k + 3) - 1e-9 * i for k in range(n - 2)), prompt_len=2,
        prompt=[{"role": "user", "content": f"q{group}"}] if group % 2 else f"q{group}",
        completion=f"c{i}", stop_reason=StopReason.LENGTH if i else StopReason.STOP, version=version,
        group_id=group, reward=math.nan if i == 2 else 0.25 * i, rewards={"f": None if i == 2 else 0.25 * i},
        reward_errors={"f": "boom"} if i == 2 else {}, row={"answer": str(group)},
        token_versions=(version,) * (n - 2) if i == 1 else (),
    )


def _groups(step: int) -> list[Group]:
    return [Group(g, tuple(_sample(i, g, step - 1) for i in range(3))) for g in (0, 1)]


def test_dump_round_trips_and_opens_with_datasets(tmp_path):
    rec = RolloutRecorder(tmp_path, every=2)
    for step in (1, 2, 3):
        rec.add(step, _groups(step))
    assert [p.name for p in rec.written] == ["steps_00000001-00000002.parquet"]
    rec.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "steps_00000001-00000002.parquet", "steps_00000003-00000003.parquet"]  # no temporary left behind

    back = read_dump(tmp_path)
    assert sorted(back) == [1, 2, 3]
    for step, groups in back.items():
        want = _groups(step)
        assert [g.group_id for g in groups] == [0, 1]
        for g, w in zip(groups, want):
            for s, t in zip(g.samples, w.samples):
                assert math.isnan(s.reward) == math.isnan(t.reward)
                same = {k: v for k, v in vars(s).items() if k != "reward"}
                assert same == {k: v for k, v in vars(t).items() if k != "reward"}

    ds = load_dataset("parquet", data_files=str(tmp_path / "*.parquet"), split="train",
                      cache_dir=str(tmp_path.parent / "hf-cache"))
    assert ds.num_rows == 18
    assert ds[0]["prompt_ids"] == [10, 11] and ds[0]["completion_ids"] == [12]
    assert ds[4]["logprobs"][2:] == list(_sample(1, 0, 0).logprobs[2:])  # float64: exact


def test_replay_of_an_empty_folder_says_so(tmp_path):
    with pytest.raises(TokenmillError, match="no rollout shards"):
        read_dump(tmp_path)


def test_a_step_recorded_twice_is_read_from_the_newer_shard(tmp_path):
    first = RolloutRecorder(tmp_path, every=3)
    for step in (1, 2, 3):
        first.add(step, _groups(step))
    again = RolloutRecorder(tmp_path, every=2)  # a resumed run records steps 2 and 3 again
    again.add(2, _groups(2)[:1])
    again.add(3, _groups(3)[:1])
    back = read_dump(tmp_path)
    assert [len(back[s]) for s in (1, 2, 3)] == [2, 1, 1]


def test_a_step_without_groups_writes_nothing(tmp_path):
    rec = RolloutRecorder(tmp_path, every=1)
    rec.add(1, [])
    rec.add(2, _groups(2))
    assert [p.name for p in rec.written] == ["steps_00000002-00000002.parquet"]
    assert sorted(read_dump(tmp_path)) == [2]

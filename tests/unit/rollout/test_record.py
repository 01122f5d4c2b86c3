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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recording.json",
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


def test_a_missing_shard_is_a_gap_named_by_its_steps(tmp_path):
    rec = RolloutRecorder(tmp_path, every=2)
    for step in range(1, 11):
        rec.add(step, [] if step in (4, 7, 8) else _groups(step))
    assert [p.name for p in rec.written][-2:] == ["steps_00000005-00000006.parquet", "steps_00000009-00000010.parquet"]
    assert sorted(read_dump(tmp_path)) == [1, 2, 3, 5, 6, 9, 10]  # whole: steps 7-8 had no groups, so no shard
    (tmp_path / "steps_00000003-00000004.parquet").unlink()
    with pytest.raises(TokenmillError, match=r"misses steps 3-4 \(no shard holds them\)"):
        read_dump(tmp_path)
    (tmp_path / "steps_00000009-00000010.parquet").unlink()  # the end is missing too: the manifest knows it
    with pytest.raises(TokenmillError, match=r"misses steps 3-4, 9-10 "):
        read_dump(tmp_path)


def test_a_truncated_shard_is_one_line_naming_it_and_its_steps(tmp_path):
    rec = RolloutRecorder(tmp_path, every=2)
    for step in (1, 2, 3, 4):
        rec.add(step, _groups(step))
    shard = tmp_path / "steps_00000003-00000004.parquet"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(TokenmillError) as refused:
        read_dump(tmp_path)
    message = str(refused.value)
    assert "\n" not in message and "steps_00000003-00000004.parquet" in message and "(steps 3-4)" in message
    assert "truncated or corrupt" in message


def test_the_fingerprint_names_each_changed_field(tmp_path):
    from tokenmill.checkpoint.recording import fingerprint_changes, run_fingerprint
    from tokenmill.config.schema import RLConfig
    from tokenmill.rollout.record import read_manifest

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama", "hidden_size": 32, "vocab_size": 99}')
    base = {"model": {"path": str(tmp_path / "m")}, "data": {"task": "addition"}}
    cfg = RLConfig.model_validate(base)
    printed = run_fingerprint(cfg)
    assert printed["model.config.hidden_size"] == 32 and printed["generation.group_size"] == cfg.generation.group_size
    RolloutRecorder(tmp_path / "rec", every=1, fingerprint=printed)
    assert read_manifest(tmp_path / "rec")["fingerprint"] == printed  # as JSON reads it back: equal
    other = RLConfig.model_validate(base | {"generation": {"group_size": 3, "max_tokens": 7}})
    assert fingerprint_changes(printed, run_fingerprint(other)) == [
        f"generation.group_size: recorded {cfg.generation.group_size}, now 3",
        f"generation.max_tokens: recorded {cfg.generation.max_tokens}, now 7"]
    assert fingerprint_changes(printed, run_fingerprint(cfg)) == []

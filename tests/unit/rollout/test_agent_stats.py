"""Agent-loop metrics: batch occupancy is measured against the slots a run could fill."""

from tokenmill.rollout.agent import AgentStats


def test_occupancy_counts_the_slots_the_run_could_fill():
    # 16 episodes with 256 slots: 2 rounds of 16 and 8 live episodes fill 24 of 32 possible rows
    assert AgentStats(rounds=2, engine_rows=24, episodes=16).report(256)["agent/batch_occupancy"] == 0.75
    # more episodes than slots: the slots are the limit (100 rows over 4 rounds of 32)
    stats = AgentStats(rounds=4, engine_rows=100, episodes=300).report(32)
    assert stats["agent/batch_occupancy"] == 100 / 128 and stats["agent/mean_batch"] == 25.0
    assert AgentStats().report(8)["agent/batch_occupancy"] == 0.0

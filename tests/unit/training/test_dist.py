"""`training.dist`: a rank's in-process engine samples each prompt from the seed of its position in the step, so
the rows a rank draws equal those rows of one process drawing the whole step (2 ranks are simulated here by
their shares; tests/e2e/test_torchrun.py runs real ranks under torchrun)."""

from __future__ import annotations

from tokenmill.training.dist import RankedEngine, ShardedRollout
from tokenmill.types import SamplingParams

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
PARAMS = SamplingParams(max_tokens=6, n=3, temperature=1.0)


class Sampler:
    """The rollout side's part that matters here: one engine call for a share of rows, one (group id,
    completions) pair per row."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def rollout(self, rows, version, first_group=0):
        drawn = self.engine.generate([r["ids"] for r in rows], PARAMS)
        return [(first_group + i, completions) for i, completions in enumerate(drawn)], {}


def _tokens(groups):
    return [(group_id, [c.token_ids for c in completions]) for group_id, completions in groups]


def test_a_share_draws_what_one_process_draws_for_those_rows(tiny_model, tokenizer):
    whole = RankedEngine(tiny_model, tokenizer, seed=3)
    whole.update_weights((), version=2)
    one, _ = ShardedRollout(Sampler(whole), whole).rollout([{"ids": p} for p in PROMPTS], version=2)
    assert len({tuple(map(tuple, t)) for _, t in _tokens(one)}) == 4  # the prompts did not all draw alike

    # rank 1 of 2: its share is rows 2 and 3, drawn in a fresh engine (another process) with the same seed
    second = RankedEngine(tiny_model, tokenizer, seed=3)
    second.update_weights((), version=2)
    second.generator.manual_seed(1234)  # a rank's RNG state before the call does not matter
    second.drawn = 2  # what ShardedRollout sets on rank 1 of 2 for 4 rows
    share = Sampler(second).rollout([{"ids": p} for p in PROMPTS[2:]], version=2, first_group=2)[0]
    assert _tokens(share) == _tokens(one)[2:]
    # and the logprobs are the same numbers
    assert [c.logprobs for _, cs in share for c in cs] == [c.logprobs for _, cs in one[2:] for c in cs]


def test_the_next_rows_and_the_next_version_draw_afresh(tiny_model, tokenizer):
    engine = RankedEngine(tiny_model, tokenizer, seed=3)
    rollout = ShardedRollout(Sampler(engine), engine)
    rows = [{"ids": PROMPTS[0]}]
    first, again = rollout.rollout(rows, version=0)[0], rollout.rollout(rows, version=0)[0]
    assert engine.drawn == 2  # one process moves past every row of every call
    assert _tokens(first)[0][1] != _tokens(again)[0][1]  # the second row of the version: another seed
    engine.update_weights((), version=1)
    assert engine.drawn == 0
    engine.generate(PROMPTS, PARAMS)  # rank 0's sampled held-out evaluation: not a rollout row
    newer = rollout.rollout(rows, version=1)[0]
    assert _tokens(newer)[0][1] != _tokens(first)[0][1]
    fresh = RankedEngine(engine.model, engine.tokenizer, seed=3)  # another rank's engine, at the same version
    fresh.update_weights((), version=1)
    assert _tokens(ShardedRollout(Sampler(fresh), fresh).rollout(rows, version=1)[0]) == _tokens(newer)
    # greedy (the held-out evaluation) is one batch, and moves no count
    greedy = engine.generate(PROMPTS, SamplingParams(max_tokens=4, greedy=True))
    assert len(greedy) == 4 and engine.drawn == 1

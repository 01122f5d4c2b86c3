"""The LLM-judge reward against real loopback servers: a tiny judge model served by tokenmill's OpenAI app
(its greedy reply is the request's last character), and scripted servers that answer slowly, fail or hang."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from tokenmill.rewards.judge import JudgeReward, parse_score, parse_winner, prompt_groups
from tokenmill.testing.judge import ScriptedJudge
from tokenmill.tracking import events
from tokenmill.types import RewardResult


def values(results: list[RewardResult]) -> list[float | None]:
    return [None if r.value is None else round(r.value, 6) for r in results]


def metrics(judge: JudgeReward) -> dict[str, float]:
    return {k.split("/", 1)[1]: v[0] for k, v in judge.last_log.metrics.items()}


# ------------------------------------------------------------------------------ parsing
def test_scores_and_winners_are_read_from_the_replies_judges_give():
    assert parse_score("The answer is right. <score>7</score>") == 0.7
    assert parse_score("<think>maybe <score>1</score></think> final: <SCORE> 9.5 </SCORE>") == 0.95
    assert parse_score(" 4 ") == 0.4 and parse_score("Yes, it is correct.") == 1.0 and parse_score("no") == 0.0
    assert parse_score("<score>11</score>") is None and parse_score("I cannot grade this") is None
    assert parse_score("3 of 5", (1, 5)) is None  # not only a number, no tag
    assert parse_score("Score: 4/5", (1, 5), r"Score:\s*(\d+)") == 0.75
    assert parse_winner("<winner>B</winner>") == 0.0 and parse_winner("A is better") == 1.0
    assert parse_winner("<winner>tie</winner>") == 0.5 and parse_winner("Neither") is None


def test_a_group_is_a_run_of_completions_of_one_prompt():
    prompts = ["p", "p", "q", "q", "q", [{"role": "user", "content": "p"}], "p"]
    assert prompt_groups(prompts, {"answer": [1, 1, 2, 2, 3, 1, 1]}) == [[0, 1], [2, 3], [4], [5], [6]]


# ------------------------------------------------------------------------------ a served judge model
def test_rubric_scores_are_the_served_judges_greedy_replies(echo_judge):
    judge = JudgeReward(echo_judge, "echo", prompt="{completion}", score_range=(0, 9), cache=False)
    try:
        completions = ["ab7", "x.3", "9", "zzA"]
        got = judge(["q"] * 4, completions, {})
        direct = [httpx.post(echo_judge + "/chat/completions", json={
            "model": "echo", "messages": [{"role": "user", "content": c}], "max_tokens": 512, "temperature": 0,
        }, timeout=60).json()["choices"][0]["message"]["content"] for c in completions]
        assert direct == ["7", "3", "9", "A"]  # what the server itself answers
        assert values(got) == [round(7 / 9, 6), round(3 / 9, 6), 1.0, None]  # "A" is no score: abstains
        assert all(r.error is None for r in got)
        assert metrics(judge) == {"requests": 4, "retries": 0, "failed": 0, "unparsed": 1, "cache_hits": 0}
    finally:
        judge.close()


def test_pairwise_win_rates_round_robin_within_each_group(echo_judge):
    # the judge names the last character of the request ({a}{b}: b's last), so a completion ending in B
    # beats one ending in A in both orders, and two of a kind split their pair
    judge = JudgeReward(echo_judge, "echo", mode="pairwise", prompt="{a}{b}")
    try:
        completions = ["xA", "yB", "zA", "wB", "solo A"]
        got = judge(["p"] * 4 + ["q"], completions, {})
        assert values(got) == [round(1 / 6, 6), round(5 / 6, 6), round(1 / 6, 6), round(5 / 6, 6), None]
        assert metrics(judge)["requests"] == 12  # 6 pairs, both orders; a group of one asks nothing
    finally:
        judge.close()


def test_pairwise_against_the_reference_column(echo_judge):
    judge = JudgeReward(echo_judge, "echo", mode="pairwise", prompt="{a}{b}", reference_column="ref")
    try:
        # (a=completion, b=ref) -> "A": the completion wins; (a=ref, b=completion) -> the completion's last
        got = judge(["p", "p"], ["cB", "cA"], {"ref": ["rA", "rA"]})
        assert values(got) == [1.0, 0.5]
        missing = judge(["p"], ["cB"], {"answer": ["rA"]})
        assert missing[0].value is None and "no column 'ref'" in missing[0].error
    finally:
        judge.close()


def test_the_judge_works_from_inside_a_running_event_loop(echo_judge):
    judge = JudgeReward(echo_judge, "echo", prompt="{completion}", score_range=(0, 9))

    async def main() -> tuple[list[RewardResult], list[RewardResult]]:
        awaited = await judge.ascore(["q"], ["ab9"])
        return awaited, judge(["q"], ["ab0"], {})  # the blocking call, from a coroutine: its own loop

    try:
        awaited, called = asyncio.run(main())
        assert values(awaited) == [1.0] and values(called) == [0.0]
    finally:
        judge.close()


# ------------------------------------------------------------------------------ scripted servers
@pytest.fixture
def script():
    made: list[ScriptedJudge] = []

    def make(**kwargs) -> ScriptedJudge:
        made.append(ScriptedJudge(**kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_no_more_requests_in_flight_than_the_concurrency_limit(script):
    server = script(delay_s=0.2)
    judge = JudgeReward(server.url, "m", rubric="correct?", concurrency=3)
    try:
        got = judge(["q"] * 12, [f"answer {i}" for i in range(12)], {})
        assert values(got) == [0.5] * 12
        assert server.requests == 12 and server.most_in_flight == 3
        # the default prompt carries the question, the completion and the rubric
        assert "q" in server.contents[0] and "answer" in server.contents[0] and "correct?" in server.contents[0]
    finally:
        judge.close()


def test_a_request_that_hangs_abstains_within_its_timeouts(script):
    server = script(delay_s=5.0)
    judge = JudgeReward(server.url, "m", rubric="r", timeout_s=0.3, retries=1, backoff_s=0.1)
    try:
        start = time.monotonic()
        got = judge(["q", "q"], ["a", "b"], {})
        elapsed = time.monotonic() - start
        assert values(got) == [None, None] and all(r.error is None for r in got)  # None: does not apply
        assert 0.7 <= elapsed < 2.0  # two tries of 0.3 s and a 0.1 s backoff, the samples concurrently
        assert metrics(judge) == {"requests": 4, "retries": 2, "failed": 2, "unparsed": 0, "cache_hits": 0}
    finally:
        judge.close()


def test_a_batch_whose_first_wave_gets_no_answer_asks_no_more(script):
    server = script(delay_s=5.0)
    judge = JudgeReward(server.url, "m", rubric="r", concurrency=2, timeout_s=0.3, retries=0)
    try:
        start = time.monotonic()
        got = judge(["q"] * 6, [str(i) for i in range(6)], {})
        assert values(got) == [None] * 6 and time.monotonic() - start < 1.0  # one round of 0.3 s, not three
        assert server.requests == 2
        assert metrics(judge) == {"requests": 2, "retries": 0, "failed": 6, "unparsed": 0, "cache_hits": 0}
    finally:
        judge.close()


def test_server_errors_are_retried_and_counted_a_bad_request_is_not(script):
    server = script(statuses=[503, 500])
    judge = JudgeReward(server.url, "m", rubric="r", retries=2, backoff_s=0.05)
    try:
        assert values(judge(["q"], ["a"], {})) == [0.5]
        assert server.requests == 3 and metrics(judge)["retries"] == 2 and metrics(judge)["failed"] == 0
        server.statuses = [400]
        assert values(judge(["q"], ["b"], {})) == [None]
        assert server.requests == 4 and metrics(judge)["retries"] == 0 and metrics(judge)["failed"] == 1
    finally:
        judge.close()


def test_a_cached_request_is_not_asked_again_also_after_a_restart(script, tmp_path):
    server = script()
    cache = tmp_path / "judge_cache" / "judge.jsonl"
    judge = JudgeReward(server.url, "m", rubric="r", cache_path=cache)
    try:
        judge(["q"] * 3, ["a", "b", "a"], {})  # a duplicate in one batch: asked once
        assert server.requests == 2
        assert values(judge(["q"] * 2, ["b", "a"], {})) == [0.5, 0.5]
        assert server.requests == 2 and metrics(judge)["cache_hits"] == 2 and metrics(judge)["requests"] == 0
        judge(["q"], ["a"], {})
        assert server.requests == 2
    finally:
        judge.close()
    again = JudgeReward(server.url, "m", rubric="r", cache_path=cache)
    try:
        assert values(again(["q", "q"], ["a", "c"], {})) == [0.5, 0.5]
        assert server.requests == 3  # only "c" was new
        other = JudgeReward(server.url, "m", rubric="another rubric", cache=False)
        other(["q"], ["a"], {})  # another rubric is another request
        other.close()
        assert server.requests == 4
    finally:
        again.close()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def test_an_endpoint_that_is_down_abstains_and_raises_the_alarm_once(tmp_path):
    said: list[str] = []
    log = events.EventLog(tmp_path / "events.jsonl")
    events.activate(log)
    judge = JudgeReward(closed_port_url(), "m", rubric="r", retries=1, backoff_s=0.01, alarm_after=2, say=said.append)
    try:
        for step in range(4):
            got = judge(["q"] * 3, ["a", "b", "c"], {}, state=None)
            assert values(got) == [None] * 3
            assert metrics(judge)["requests"] == (6 if step < 2 else 2)  # once down: one request first
        assert judge.down_batches == 4 and len(judge.alarms) == 1 and len(said) == 1
        assert said[0].startswith("alarm (warn) judge_down: judge 'judge' at http://127.0.0.1:")
        assert "answered no request in 2 consecutive batches" in said[0]
    finally:
        judge.close()
        events.deactivate(log)
        log.close()
    rows = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    alarms = [r for r in rows if r["event"] == "alarm"]
    assert len(alarms) == 1 and alarms[0]["name"] == "judge_down" and alarms[0]["policy"] == "warn"
    failed = [r for r in rows if r["event"] == "reward_failed"]
    assert len(failed) == 4 and failed[0]["failed"] == 3
    assert failed[0]["errors"][0]["error"].startswith("judge 'judge': APIConnectionError: Connection error")


def test_the_judge_recovers_when_the_endpoint_answers_again(script):
    server = script(statuses=[503] * 4)
    said: list[str] = []
    judge = JudgeReward(server.url, "m", rubric="r", retries=0, alarm_after=2, say=said.append)
    try:
        assert values(judge(["q"], ["a"], {})) == [None] and values(judge(["q"], ["b"], {})) == [None]
        assert len(said) == 1 and "HTTP 503" in said[0]
        server.statuses = []
        assert values(judge(["q", "q"], ["c", "d"], {})) == [0.5, 0.5]
        assert judge.down_batches == 0 and said[-1].endswith("answers again")
    finally:
        judge.close()


def test_a_fault_of_the_judge_itself_fails_the_samples_instead_of_raising(script):
    server = script(reply=lambda content: "score 7")
    judge = JudgeReward(server.url, "m", prompt="{completion}", score_pattern=r"\d")  # no group to read
    try:
        got = judge(["q", "q"], ["a", "b"], {})
        assert [r.value for r in got] == [None, None]
        assert got[0].error == "judge 'judge': IndexError: no such group"
    finally:
        judge.close()

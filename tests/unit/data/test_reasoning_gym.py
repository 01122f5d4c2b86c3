"""reasoning-gym tasks as row tasks: config shape and messages, held-out rows disjoint from training, the
reward equal to the generator's own score_answer, answer extraction (and its log), mixture weights."""

from __future__ import annotations

import pickle
import sys

import pytest
import reasoning_gym

from tokenmill.config import RLConfig, load_config
from tokenmill.data import reasoning_gym as gym
from tokenmill.data.registry import HELD_OUT_SEED_OFFSET, task_splits
from tokenmill.rewards.base import FunctionReward
from tokenmill.types import ConfigError

CHAIN = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
SPELL = {"min_word_len": 3, "max_word_len": 5}
MIX = {"datasets": [{"name": "chain_sum", "weight": 3.0, "kwargs": CHAIN},
                    {"name": "spell_backward", "weight": 1.0, "kwargs": SPELL}]}


def _cfg(task, **kwargs):
    return load_config(RLConfig, {"model": {"path": "m"}, "data": {"task": task, "task_kwargs": kwargs}})


def _error(task, **kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        _cfg(task, **kwargs)
    return str(err.value)


def _score(reward, rows, completions, log=None):
    return reward(prompts=rows["prompt"], completions=completions, rg_source=rows["rg_source"],
                  rg_seed=rows["rg_seed"], rg_index=rows["rg_index"], log_extra=log)


# ------------------------------------------------------------------------------------------------- config


def test_config_takes_a_task_its_generator_settings_and_the_answer_options():
    cfg = _cfg("reasoning_gym:chain_sum", max_terms=3, answer_format="last_line")
    assert cfg.data.task == "reasoning_gym:chain_sum"
    spec = gym.parse_spec(cfg.data.task, cfg.data.task_kwargs)
    assert spec.sources == (gym.Source("chain_sum", 1.0, {"max_terms": 3}),)
    assert spec.options.answer_format == "last_line" and spec.options.answer_tag == "answer"
    mix = gym.parse_spec("reasoning_gym:mix", MIX)
    assert [(s.name, s.weight) for s in mix.sources] == [("chain_sum", 3.0), ("spell_backward", 1.0)]
    assert mix.sources[1].kwargs == SPELL


@pytest.mark.parametrize(("task", "kwargs", "message"), [
    ("reasoning_gym:chain_summ", {}, ("data.task: 'reasoning_gym:chain_summ' is not a reasoning-gym task; did you "
     "mean reasoning_gym:chain_sum")),
    ("reasoning_gym:chain_sum", {"max_term": 3}, ("data.task_kwargs.max_term: not a setting of reasoning-gym's "
     "chain_sum (ChainSumConfig); did you mean max_terms")),
    ("reasoning_gym:chain_sum", {"seed": 3}, "data.task_kwargs.seed: set by tokenmill (training.seed"),
    ("reasoning_gym:chain_sum", {"min_terms": 4, "max_terms": 2}, ("data.task_kwargs: reasoning-gym's chain_sum "
     "rejects these settings: max_terms must be >= min_terms")),
    ("reasoning_gym:chain_sum", {"answer_format": "boxed"}, ("data.task_kwargs.answer_format: Input should be "
     "'tag' or 'last_line'")),
    ("reasoning_gym:chain_sum", {"datasets": []}, "data.task_kwargs.datasets: only for reasoning_gym:mix"),
    ("reasoning_gym:mix", {}, "data.task_kwargs.datasets: reasoning_gym:mix needs a list of {name, weight, kwargs}"),
    ("reasoning_gym:mix", {"datasets": [{"name": "chain_sum", "weight": 0}]},
     "data.task_kwargs.datasets.0.weight: Input should be greater than 0"),
    ("reasoning_gym:mix", {"datasets": [{"name": "chain_sum"}, {"name": "spel_backward"}]},
     ("data.task_kwargs.datasets.1.name: 'spel_backward' is not a reasoning-gym task; did you mean "
     "reasoning_gym:spell_backward?")),
    ("reasoning_gym:mix", {"datasets": [{"name": "chain_sum", "kwargs": {"max_digit": 1}}]},
     "data.task_kwargs.datasets.0.kwargs.max_digit: not a setting of reasoning-gym's chain_sum"),
    ("reasoning_gym:mix", {"max_terms": 2, "datasets": [{"name": "chain_sum"}]},
     "data.task_kwargs.max_terms: a mixture's generator settings go in each data.task_kwargs.datasets.N.kwargs"),
])
def test_bad_settings_are_one_line_naming_the_dotted_field(task, kwargs, message):
    text = _error(task, **kwargs)
    assert text.startswith(message), text
    assert "\n" not in text


def test_an_unknown_plain_task_suggests_the_closest_names_of_both_families():
    assert _error("additon") == ("data: data.task must be one of addition, countdown, shapes, guess_number, "
                                 "coding, calculator, gym; got 'additon'; did you mean addition?")
    assert _error("spell_backwards").endswith("got 'spell_backwards'; did you mean reasoning_gym:spell_backward?")


def test_a_missing_package_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` now raises ImportError
    text = _error("reasoning_gym:chain_sum")
    assert text == ("data.task: reasoning_gym tasks need the reasoning-gym package: pip install tokenmill[tasks]")
    with pytest.raises(ConfigError, match=r"pip install tokenmill\[tasks\]"):
        task_splits("reasoning_gym:chain_sum", 2, 0)


# ------------------------------------------------------------------------------------------------- rows


def test_held_out_rows_come_from_the_offset_seed_and_never_appear_in_training():
    # a small space (100 questions): the exclusion really has something to exclude
    train, held, reward = task_splits("reasoning_gym:chain_sum", 400, 30, seed=3, **CHAIN)
    assert len(train) == 400 and len(held) == 30
    assert not set(train["question"]) & set(held["question"])
    assert len(set(held["question"])) == 30  # distinct held-out questions
    generator = reasoning_gym.create_dataset("chain_sum", **CHAIN, seed=3 + HELD_OUT_SEED_OFFSET, size=10)
    assert held[0]["question"] == generator[0]["question"] and held[0]["answer"] == generator[0]["answer"]
    assert set(held["rg_seed"]) == {3 + HELD_OUT_SEED_OFFSET} and set(train["rg_seed"]) == {3}
    assert train[0]["prompt"] == train[0]["question"] and train[0]["completion"] == f"<answer>{train[0]['answer']}</answer>"
    assert reward.__name__ == "reasoning_gym:chain_sum"
    assert task_splits("reasoning_gym:chain_sum", 5, 0, **CHAIN)[1] is None


def test_a_held_out_split_larger_than_the_question_space_names_the_field():
    with pytest.raises(ConfigError, match=r"^data.num_eval: reasoning_gym:chain_sum made only \d+ usable questions"):
        task_splits("reasoning_gym:chain_sum", 10, 250, min_terms=2, max_terms=2, min_digits=1, max_digits=1,
                    allow_negation=False)


def test_chat_prompts_carry_a_system_prompt_naming_the_answer_format():
    train, _, _ = task_splits("reasoning_gym:spell_backward", 2, 0, chat=True, answer_tag="final", **SPELL)
    system, user = train[0]["prompt"]
    assert system["role"] == "system" and "<final>answer here</final>" in system["content"]
    assert user == {"role": "user", "content": train[0]["question"]}
    own, _, _ = task_splits("reasoning_gym:spell_backward", 1, 0, chat=True, system_prompt="Be brief.", **SPELL)
    assert own[0]["prompt"][0]["content"] == "Be brief."


def test_mixture_draws_sources_by_weight_with_their_own_settings():
    train, held, _ = task_splits("reasoning_gym:mix", 2000, 50, seed=1, **MIX)
    share = train["rg_task"].count("chain_sum") / len(train)
    assert 0.72 < share < 0.78, share  # weights 3 : 1
    spelled = [q for q, t in zip(train["question"], train["rg_task"], strict=True) if t == "spell_backward"]
    assert all(3 <= len(q.rpartition(" ")[2]) <= 5 for q in spelled)
    assert set(train["rg_source"]) == {0, 1} and not set(train["question"]) & set(held["question"])


# ------------------------------------------------------------------------------------------------- reward


def test_reward_is_the_generators_own_score_answer():
    train, _, reward = task_splits("reasoning_gym:spell_backward", 6, 0, answer_format="last_line", **SPELL)
    rows = train[:]
    generator = reasoning_gym.create_dataset("spell_backward", **SPELL, seed=0, size=10)
    a = rows["answer"]
    guesses = [a[0], a[1][:-1] + "#", "", a[3].upper(), "thinking\n" + a[4], "nope"]
    expected = [generator.score_answer(g.splitlines()[-1] if g else None, generator[i])
                for i, g in zip(rows["rg_index"], guesses, strict=True)]
    got = _score(reward, rows, guesses)
    assert got == expected
    assert got[0] == 1.0 and 0.0 < got[1] < 1.0 and got[2] == 0.0 and got[3] == 1.0 and got[4] == 1.0


def test_tag_extraction_takes_the_last_tag_and_logs_what_it_read():
    train, _, reward = task_splits("reasoning_gym:chain_sum", 3, 0, **CHAIN)
    rows = train[:]
    a = rows["answer"]
    logged = {}
    got = _score(reward, rows, [f"<answer>{a[0]}</answer>", f"<answer>1000</answer> so <answer> {a[1]} </answer>",
                                f"{a[2]}"], log=lambda column, values: logged.setdefault(column, values))
    assert got == [1.0, 1.0, 0.0]  # no tag: nothing extracted, scored as no answer
    assert logged == {"extracted_answer": [a[0], a[1], None]}
    opts = gym.GymOptions(answer_format="last_line")
    assert gym.extract_answer("let me see\n\n  42  \n", opts) == "42" and gym.extract_answer(" \n", opts) is None


def test_through_function_reward_each_sample_carries_its_extracted_answer():
    train, _, scorer = task_splits("reasoning_gym:chain_sum", 2, 0, **CHAIN)
    rows = train[:]
    reward = FunctionReward(scorer, isolation="thread")
    columns = {k: v for k, v in rows.items() if k != "prompt"}
    results = reward(rows["prompt"], [f"<answer>{rows['answer'][0]}</answer>", "no idea"], columns)
    assert [r.value for r in results] == [1.0, 0.0]
    assert [r.extra for r in results] == [{"extracted_answer": rows["answer"][0]}, {"extracted_answer": None}]
    reward.close()


def test_a_pickled_reward_regenerates_the_entries_and_scores_the_same():
    train, _, scorer = task_splits("reasoning_gym:mix", 20, 0, seed=2, **MIX)
    rows = train[:]
    copy = pickle.loads(pickle.dumps(scorer))
    assert copy._entries == {} and len(scorer._entries) == 20
    completions = [f"<answer>{a}</answer>" for a in rows["answer"]]
    assert _score(copy, rows, completions) == _score(scorer, rows, completions) == [1.0] * 20

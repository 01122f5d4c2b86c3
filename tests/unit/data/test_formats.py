"""TRL's dataset formats in SFT, RL and preference training: each one TRL's SFTTrainer, GRPOTrainer and
DPOTrainer accept trains here (real jsonl files, the tiny model), and data of another kind of training is
refused in one line naming the column and the formats taken."""

from __future__ import annotations

import json
import math

import pytest

import tokenmill
from tokenmill.cli import main
from tokenmill.data.formats import implicit_prompt, pair_rows
from tokenmill.training.sft import sft_samples

USER = {"role": "user", "content": "1+1="}
ANSWER = {"role": "assistant", "content": "2"}
WRONG = {"role": "assistant", "content": "3"}
SFT_ROWS = {
    "text": {"text": "1+1=2"},
    "messages": {"messages": [USER, ANSWER]},
    "prompt-completion": {"prompt": "1+1=", "completion": "2"},
    "conversational prompt-completion": {"prompt": [USER], "completion": [ANSWER]},
}
PAIR_ROWS = {
    "preference": {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
    "conversational preference": {"prompt": [USER], "chosen": [ANSWER], "rejected": [WRONG]},
    "implicit prompt": {"chosen": "1+1= 2", "rejected": "1+1= 3"},
    "conversational implicit prompt": {"chosen": [USER, ANSWER], "rejected": [USER, WRONG]},
}


def _jsonl(tmp_path, row: dict, n: int = 8) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for _ in range(n)))
    return str(path)


@pytest.mark.parametrize("kind", SFT_ROWS)
def test_sft_trains_on_each_trl_sft_format(kind, tiny_model_path, tmp_path, capsys):
    # the conversational prompt-completion row crashed: "text input must be of type str"
    argv = ["sft", "--model.path", tiny_model_path, "--data.path", _jsonl(tmp_path, SFT_ROWS[kind]), "--steps", "2",
            "--batch_size", "4", "--output_dir", str(tmp_path / "out")]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("sft: loss ")
    assert (tmp_path / "out" / "config.json").exists()


def test_each_sft_format_trains_what_trl_trains(tokenizer):
    def trained(row, **columns):
        sample = sft_samples(tokenizer, [row], **columns)[0]
        return tokenizer.decode([t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m])

    eos = tokenizer.eos_token
    assert trained(SFT_ROWS["prompt-completion"]) == "2" + eos
    assert trained(SFT_ROWS["conversational prompt-completion"]) == "2<|end|>"  # the completion, not the prompt
    assert trained(SFT_ROWS["messages"], messages_column="messages") == "2<|end|>"
    assert trained(SFT_ROWS["text"], text_column="text") == "+1=2" + eos  # all but the first token (no BOS)
    # a prompt's earlier assistant turn is context, not trained: only the completion's message is
    row = {"prompt": [USER, WRONG, {"role": "user", "content": "again"}], "completion": [ANSWER]}
    assert trained(row) == "2<|end|>"


@pytest.mark.parametrize("row, message", [
    ({"prompt": "1+1="}, ("completion_column: column 'completion' not in the dataset (columns: prompt); SFT takes "
                          "text, messages, prompt + completion (standard or conversational)")),
    (PAIR_ROWS["preference"], "preference data (tokenmill preference)"),
    ({"prompt": "1+1=", "completion": [ANSWER]}, ("completion_column: row 0: a conversational completion needs "
                                                  "a conversational prompt")),
    ({"prompt": 7, "completion": "2"}, "data.prompt_column: row 0 holds int; SFT takes text, messages"),
])
def test_sft_refuses_other_data_in_one_line(row, message, tiny_model_path, tmp_path, capsys):
    argv = ["sft", "--model.path", tiny_model_path, "--data.path", _jsonl(tmp_path, row), "--steps", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_implicit_prompts_are_the_common_start():
    assert implicit_prompt("1+1= 2", "1+1= 3") == ("1+1=", " 2", " 3")  # the space stays with the answers
    assert implicit_prompt([USER, ANSWER], [USER, WRONG]) == ([USER], [ANSWER], [WRONG])


def test_every_preference_format_becomes_the_same_pairs(tokenizer):
    rows = {kind: pair_rows(tokenizer, [row])[0] for kind, row in PAIR_ROWS.items()}
    assert rows["preference"] == PAIR_ROWS["preference"]
    assert rows["implicit prompt"] == {"prompt": "1+1=", "chosen": " 2", "rejected": " 3"}
    chat = {"prompt": [USER], "chosen": "2<|end|>", "rejected": "3<|end|>"}  # rendered as the template writes them
    assert rows["conversational preference"] == chat and rows["conversational implicit prompt"] == chat


@pytest.mark.parametrize("kind", PAIR_ROWS)
@pytest.mark.parametrize("objective", ["dpo", "reward_model"])
def test_preference_trains_on_each_trl_preference_format(kind, objective, tiny_model_path, tmp_path):
    result = tokenmill.preference({"model": {"path": tiny_model_path}, "objective": objective, "steps": 2,
                                   "batch_size": 4, "data": {"path": _jsonl(tmp_path, PAIR_ROWS[kind])},
                                   "output_dir": str(tmp_path / "out")})
    assert len(result["losses"]) == 2 and all(math.isfinite(v) for v in result["losses"])
    if objective == "dpo":
        assert result["losses"][0] == pytest.approx(math.log(2), abs=1e-4)  # the policy is its own reference


def test_preference_refuses_sft_data_naming_the_formats(tiny_model_path, tmp_path, capsys):
    argv = ["preference", "--model.path", tiny_model_path, "--data.path", _jsonl(tmp_path, SFT_ROWS["messages"])]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "data.path: the pairs need columns ['chosen', 'rejected'] (columns: messages); preference training " \
           "takes prompt + chosen + rejected, or chosen + rejected with an implicit prompt" in err
    assert "a conversation is SFT data (tokenmill sft)" in err


@pytest.mark.parametrize("row", [{"prompt": "1+1="}, {"prompt": [USER]}, SFT_ROWS["prompt-completion"]])
def test_rl_takes_prompt_only_rows_standard_or_conversational(row, tiny_model_path, tmp_path):
    result = tokenmill.train({
        "model": {"path": tiny_model_path, "device": "cpu"}, "data": {"path": _jsonl(tmp_path, row)},
        "rewards": [{"function": f"{__name__}:length_reward", "isolation": "thread"}],
        "generation": {"group_size": 2, "max_tokens": 2}, "controller": {"steps": 1, "prompts_per_step": 2},
        "tracking": {"output_dir": str(tmp_path / "run"), "console": "none"},
        "checkpoint": {"every": 0, "save_final": False}})
    assert result["last_metrics"]["reward/mean"] >= 0.0


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("kind, hint", [("messages", "a conversation is SFT data (tokenmill sft)"),
                                        ("text", "plain text is SFT data (tokenmill sft)")])
def test_rl_refuses_sft_data_naming_the_formats(kind, hint, tmp_path, capsys):
    argv = ["validate", "--model.path", "org/model", "--data.path", _jsonl(tmp_path, SFT_ROWS[kind]),
            "--rewards", json.dumps([{"function": f"{__name__}:length_reward"}])]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"data.prompt_column: column 'prompt' not in the dataset (columns: {kind}); RL takes prompt-only " in err
    assert hint in err

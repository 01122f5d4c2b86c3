"""TRL's dataset formats: which one a dataset is in, for each kind of training, or a one-line refusal.

A format is standard (strings) or conversational (lists of `{role, content}` messages) and one of these types:
language modeling (`text` / `messages`), prompt-only (`prompt`), prompt-completion (`prompt`, `completion`) and
preference (`prompt`, `chosen`, `rejected`; or `chosen`, `rejected` with the prompt implicit: their common
start). SFT takes language modeling and prompt-completion rows, RL takes prompts, preference training takes
pairs. The table in docs/usage.md lists them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.data.chat import ChatTemplateError
from tokenmill.types import ConfigError

SFT_FORMATS = ("text", "messages", "prompt + completion (standard or conversational)")
RL_FORMATS = "prompt-only rows (a string or a list of messages), or prompt-completion rows (the prompt is used)"
PAIR_FORMATS = "prompt + chosen + rejected, or chosen + rejected with an implicit prompt (standard or conversational)"
OTHER_TRAINING = {
    "messages": "a conversation is SFT data (tokenmill sft)",
    "text": "plain text is SFT data (tokenmill sft)",
    "chosen": "chosen / rejected pairs are preference data (tokenmill preference)",
}


def is_conversation(value: Any) -> bool:
    """A list of `{role, ...}` messages (TRL's conversational format)."""
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


def _what_it_is(columns: Sequence[str]) -> str:
    return "; ".join(why for column, why in OTHER_TRAINING.items() if column in columns)


def sft_columns(columns: Sequence[str], prompt_column: str, completion_column: str,
                messages_column: str | None) -> dict[str, str]:
    """The columns an SFT run reads: {"messages": c}, {"prompt": p, "completion": c} or {"text": "text"}. A
    `messages` or `text` column serves when the prompt / completion columns are absent."""
    if messages_column is not None:
        if messages_column not in columns:
            raise ConfigError(f"messages_column: column {messages_column!r} not in the dataset "
                              f"(columns: {', '.join(columns)})")
        return {"messages": messages_column}
    if prompt_column in columns and completion_column in columns:
        return {"prompt": prompt_column, "completion": completion_column}
    if "messages" in columns:
        return {"messages": "messages"}
    if "text" in columns:
        return {"text": "text"}
    if prompt_column in columns:
        field, column = "completion_column", completion_column
        hint = _what_it_is(columns) or "prompt-only rows are RL data (tokenmill train)"
    else:
        field, column, hint = "data.prompt_column", prompt_column, _what_it_is(columns)
    raise ConfigError(
        f"{field}: column {column!r} not in the dataset (columns: {', '.join(columns)}); SFT takes "
        f"{', '.join(SFT_FORMATS)} (data.prompt_column / completion_column / messages_column name other columns)"
        + (f"; {hint}" if hint else ""))


def rl_prompt_problem(columns: Sequence[str], prompt_column: str) -> str | None:
    """Why an RL dataset with `columns` has no prompts to sample from (None when it has)."""
    if prompt_column in columns:
        return None
    hint = _what_it_is(columns)
    return (f"data.prompt_column: column {prompt_column!r} not in the dataset (columns: {', '.join(columns[:20])}"
            f"{', ...' if len(columns) > 20 else ''}); RL takes {RL_FORMATS}" + (f"; {hint}" if hint else ""))


def pair_problem(columns: Sequence[str]) -> str | None:
    """Why a preference dataset with `columns` is not one of TRL's preference formats (None when it is)."""
    missing = [c for c in ("chosen", "rejected") if c not in columns]
    if not missing:
        return None
    hint = _what_it_is([c for c in columns if c != "chosen"])
    return (f"data.path: the pairs need columns {missing} (columns: {', '.join(columns)}); "
            f"preference training takes {PAIR_FORMATS}" + (f"; {hint}" if hint else ""))


def implicit_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a pair whose prompt is their common start, as TRL extracts it: the
    shared messages of a conversation, or the shared characters of two strings (a space before the split
    stays with the completions)."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if isinstance(chosen, str) and n and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def render_prompt(tokenizer: Any, prompt: Any) -> str:
    """A prompt as the text the policy continues: a string as it is, messages through the chat template with
    its generation prompt."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)


def completion_text(tokenizer: Any, prompt: list[dict], completion: list[dict]) -> str:
    """A conversational completion as text: the chat template's rendering of prompt + completion past the
    rendered prompt (with its generation prompt), as TRL renders it."""
    head = render_prompt(tokenizer, prompt)
    full = tokenizer.apply_chat_template(list(prompt) + list(completion), tokenize=False)
    if not full.startswith(head):
        raise ChatTemplateError("the chat template does not render the prompt as the start of prompt + completion, "
                                "so the completion's text cannot be located")
    return full[len(head):]


def pair_rows(tokenizer: Any, rows) -> list[dict[str, Any]]:
    """Preference rows of any TRL preference format as {"prompt", "chosen", "rejected"} with string
    completions; a conversational prompt stays a list of messages (the chat template renders it). Refuses a
    row mixing strings and conversations, naming the row and the column."""
    out = []
    for i in range(len(rows)):
        row = rows[i]
        prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
        if prompt is None:
            prompt, chosen, rejected = implicit_prompt(chosen, rejected)
        for column, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if not (isinstance(value, str) or is_conversation(value)):
                raise ConfigError(f"data.path: row {i}: column {column!r} is {type(value).__name__}; preference "
                                  f"training takes {PAIR_FORMATS}")
        kinds = {column: is_conversation(v) for column, v in (("chosen", chosen), ("rejected", rejected))}
        if kinds["chosen"] != kinds["rejected"] or (isinstance(prompt, str) and prompt and any(kinds.values())):
            raise ConfigError(f"data.path: row {i}: strings and conversations mixed in one pair; preference "
                              f"training takes {PAIR_FORMATS}")
        if kinds["chosen"]:
            prompt = list(prompt or [])
            chosen, rejected = (completion_text(tokenizer, prompt, c) for c in (chosen, rejected))
        out.append({**row, "prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out

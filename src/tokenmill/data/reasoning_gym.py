"""reasoning-gym's procedural tasks as row tasks: `data.task: reasoning_gym:<name>` (or `reasoning_gym:mix`).

Rows come from the package's own generators and are scored by the generator's own `score_answer`, so a run
trains on exactly what reasoning-gym users evaluate. `data.task_kwargs` holds the generator's settings
(the fields of its config dataclass, e.g. `max_terms` for chain_sum) plus this adapter's own options:

    answer_format  'tag' (default): the answer is the text in the last <answer>...</answer> (reasoning-gym's
                   own convention); 'last_line': the completion's last non-empty line
    answer_tag     the tag's name for 'tag' (default 'answer')
    chat           prompts as chat messages (a system prompt, then the question) instead of the question text
    system_prompt  the system message of chat prompts (default: one that asks for the answer format)
    datasets       reasoning_gym:mix only: a list of {name, weight, kwargs}, sampled by weight

Held-out rows are generated with `seed + HELD_OUT_SEED_OFFSET` (distinct questions), and a training row whose
question is also a held-out one is skipped, so no held-out question is ever trained on. The reward logs what it extracted from
each completion (`log_extra("extracted_answer", ...)`), so a sample that scored 0 shows why.

    >>> train, held, reward = splits("reasoning_gym:chain_sum", 4, 2, seed=0, max_terms=2)   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import difflib
import random
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenmill.types import ConfigError

PREFIX = "reasoning_gym:"
MIX = "mix"
EXTRA = "pip install tokenmill[tasks]"
# sources of a mixture draw from seeds this far apart, so two sources never share a generator stream
SOURCE_SEED_STRIDE = 1_000_000
TRIES_PER_ROW = 20  # candidate rows per wanted training row before the held-out exclusion gives up
_OWN = ("seed", "size")  # generator settings tokenmill sets itself
_NOT_OFFERED = ("composite",)  # reasoning-gym's own mixture: use reasoning_gym:mix


class MixEntry(BaseModel):
    """One source of a mixture."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., description="A reasoning-gym task name (chain_sum, spell_backward, ...).")
    weight: float = Field(1.0, gt=0.0, description="Relative share of the rows drawn from this task.")
    kwargs: dict = Field(default_factory=dict, description="The task generator's settings.")


class GymOptions(BaseModel):
    """The adapter's own keys in `data.task_kwargs` (the rest are the generator's settings)."""

    model_config = ConfigDict(extra="forbid")
    answer_format: Literal["tag", "last_line"] = "tag"
    answer_tag: str = Field("answer", pattern=r"^[A-Za-z_][A-Za-z0-9_-]*$")
    chat: bool = False
    system_prompt: str | None = None
    datasets: list[MixEntry] | None = None


OPTION_KEYS = tuple(GymOptions.model_fields)


@dataclass(frozen=True)
class Source:
    name: str
    weight: float
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class GymSpec:
    """A parsed `reasoning_gym:` task: its sources (one, or a mixture's) and the answer options."""

    task: str
    sources: tuple[Source, ...]
    options: GymOptions = field(default_factory=GymOptions)


def is_gym_task(task: str | None) -> bool:
    return isinstance(task, str) and task.startswith(PREFIX)


def _package():
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(f"data.task: reasoning_gym tasks need the reasoning-gym package: {EXTRA}") from None
    return reasoning_gym


def gym_names() -> list[str]:
    """Every reasoning-gym task name this adapter offers (without the `reasoning_gym:` prefix), sorted."""
    _package()
    from reasoning_gym.factory import DATASETS

    return sorted(n for n in DATASETS if n not in _NOT_OFFERED)


def close_names(word: str, n: int = 3) -> list[str]:
    """The reasoning-gym names closest to `word` (prefixed), [] when the package is missing."""
    try:
        names = gym_names()
    except ConfigError:
        return []
    return [PREFIX + m for m in difflib.get_close_matches(word.removeprefix(PREFIX), [*names, MIX], n=n, cutoff=0.6)]


def _check_settings(name: str, kwargs: dict[str, Any], where: str) -> None:
    """The generator's settings fit its config dataclass and pass its own validation."""
    from reasoning_gym.factory import DATASETS

    _, config_cls = DATASETS[name]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in _OWN]
    for key in kwargs:
        if key in _OWN:
            raise ConfigError(f"{where}.{key}: set by tokenmill (training.seed seeds the rows, data.num_train "
                              "and data.num_eval count them)")
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=3, cutoff=0.6)
            hint = f"did you mean {' or '.join(close)}?" if close else f"it takes {', '.join(fields)}"
            raise ConfigError(f"{where}.{key}: not a setting of reasoning-gym's {name} "
                              f"({config_cls.__name__}); {hint}")
    try:
        config = config_cls(**kwargs)
        if hasattr(config, "validate"):
            config.validate()
    except Exception as exc:  # noqa: BLE001 - generators check with assert, ValueError, or whatever they raise
        raise ConfigError(f"{where}: reasoning-gym's {name} rejects these settings: {exc or type(exc).__name__}") from None


def _known(name: str, where: str, shown: str) -> None:
    if name not in gym_names():
        close = close_names(name)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise ConfigError(f"{where}: {shown!r} is not a reasoning-gym task{hint}")


def parse_spec(task: str, kwargs: dict[str, Any]) -> GymSpec:
    """The spec of `task` with `data.task_kwargs` = kwargs; ConfigError naming the dotted field otherwise."""
    _package()
    name = task.removeprefix(PREFIX)
    own = {k: v for k, v in kwargs.items() if k in OPTION_KEYS}
    try:
        options = GymOptions.model_validate(own)
    except ValidationError as exc:
        e = exc.errors()[0]
        loc = ".".join(str(p) for p in e["loc"])
        raise ConfigError(f"data.task_kwargs.{loc}: {e['msg']}") from None
    if name != MIX:
        _known(name, "data.task", task)
        if options.datasets is not None:
            raise ConfigError(f"data.task_kwargs.datasets: only for {PREFIX}{MIX} (a mixture of tasks)")
        settings = {k: v for k, v in kwargs.items() if k not in OPTION_KEYS}
        _check_settings(name, settings, "data.task_kwargs")
        return GymSpec(task, (Source(name, 1.0, settings),), options)
    if not options.datasets:
        raise ConfigError(f"data.task_kwargs.datasets: {PREFIX}{MIX} needs a list of {{name, weight, kwargs}}")
    stray = [k for k in kwargs if k not in OPTION_KEYS]
    if stray:
        raise ConfigError(f"data.task_kwargs.{stray[0]}: a mixture's generator settings go in each "
                          "data.task_kwargs.datasets.N.kwargs")
    for i, entry in enumerate(options.datasets):
        _known(entry.name, f"data.task_kwargs.datasets.{i}.name", entry.name)
        _check_settings(entry.name, entry.kwargs, f"data.task_kwargs.datasets.{i}.kwargs")
    sources = tuple(Source(e.name, e.weight, dict(e.kwargs)) for e in options.datasets)
    return GymSpec(task, sources, options.model_copy(update={"datasets": None}))


# ------------------------------------------------------------------------------------------------- rows


def _dataset(source: Source, seed: int, size: int):
    from reasoning_gym import create_dataset

    return create_dataset(source.name, **source.kwargs, seed=seed, size=max(1, size))


def format_answer(answer: str, options: GymOptions) -> str:
    """A reference completion in the answer format (the rows' `completion`, for supervised warm starts)."""
    return f"<{options.answer_tag}>{answer}</{options.answer_tag}>" if options.answer_format == "tag" else answer


def system_prompt(options: GymOptions) -> str:
    if options.system_prompt is not None:
        return options.system_prompt
    if options.answer_format == "tag":
        tag = options.answer_tag
        return (f"Answer the question. Think first if you need to, then give only the final answer in the form "
                f"<{tag}>answer here</{tag}>.")
    return "Answer the question. Think first if you need to, then give only the final answer on the last line."


def _row(spec: GymSpec, src: int, seed: int, idx: int, entry: dict[str, Any]) -> dict[str, Any]:
    question, answer = str(entry["question"]), "" if entry.get("answer") is None else str(entry["answer"])
    prompt: Any = question
    if spec.options.chat:
        prompt = [{"role": "system", "content": system_prompt(spec.options)}, {"role": "user", "content": question}]
    return {"prompt": prompt, "completion": format_answer(answer, spec.options), "answer": answer,
            "question": question, "rg_task": spec.sources[src].name, "rg_source": src, "rg_seed": seed,
            "rg_index": idx}


def generate_rows(spec: GymSpec, n: int, seed: int, exclude: set[str] | None = None, *, distinct: bool = False,
                  scorer: GymScorer | None = None, field_name: str = "data.num_train") -> list[dict[str, Any]]:
    """`n` rows, each drawn from a source picked by weight (a stream of its own, seeded by `seed`); a row whose
    question is in `exclude` (or, with `distinct`, already drawn) is skipped. `scorer` keeps the generated
    entries so that it need not regenerate them."""
    banned = set(exclude or ())
    pick = random.Random(seed)
    weights = [s.weight for s in spec.sources]
    cap = max(n * TRIES_PER_ROW, 1000)
    seeds = [seed + j * SOURCE_SEED_STRIDE for j in range(len(spec.sources))]
    datasets = [_dataset(s, seeds[j], cap) for j, s in enumerate(spec.sources)]
    nexts = [0] * len(spec.sources)
    rows: list[dict[str, Any]] = []
    tries = 0
    while len(rows) < n:
        # the source first, then its next usable question: a skipped question does not shift the mixture's shares
        j = pick.choices(range(len(weights)), weights=weights)[0] if len(weights) > 1 else 0
        while True:
            if tries >= cap:
                raise ConfigError(f"{field_name}: {spec.task} made only {len(rows)} usable questions in {cap} "
                                  "tries (held-out questions are distinct and never trained on); lower "
                                  "data.num_eval or widen data.task_kwargs")
            tries += 1
            idx, nexts[j] = nexts[j], nexts[j] + 1
            entry = datasets[j][idx]
            if str(entry["question"]) not in banned:
                break
        if distinct:
            banned.add(str(entry["question"]))
        if scorer is not None:
            scorer.remember(j, seeds[j], idx, entry)
        rows.append(_row(spec, j, seeds[j], idx, entry))
    return rows


def splits(task: str, num_train: int, num_eval: int, seed: int = 0, **kwargs: Any):
    """(train rows, held-out rows or None, the reward): the registry's `task_splits` for `reasoning_gym:` tasks."""
    from datasets import Dataset

    from tokenmill.data.registry import HELD_OUT_SEED_OFFSET

    spec = parse_spec(task, kwargs)
    scorer = GymScorer(spec)
    held_rows = generate_rows(spec, num_eval, seed + HELD_OUT_SEED_OFFSET, distinct=True, scorer=scorer,
                              field_name="data.num_eval") if num_eval else []
    exclude = {r["question"] for r in held_rows}
    train = Dataset.from_list(generate_rows(spec, num_train, seed, exclude=exclude, scorer=scorer))
    return train, Dataset.from_list(held_rows) if held_rows else None, scorer


# ----------------------------------------------------------------------------------------------- reward


def extract_answer(text: str, options: GymOptions) -> str | None:
    """The answer a completion gives in the answer format; None when it gives none."""
    if options.answer_format == "tag":
        from reasoning_gym.utils import extract_answer as extract_tag

        return extract_tag(text, tag_name=options.answer_tag)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def _text(completion: Any) -> str:
    """A completion's text (a chat completion comes as a list holding one assistant message)."""
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))
    return str(completion)


class GymScorer:
    """The reward of a `reasoning_gym:` task: each completion's extracted answer scored by the generator's own
    `score_answer(answer, entry)`. Called as TRL calls rewards; needs the rows' `rg_source`, `rg_seed` and
    `rg_index` columns, from which it regenerates an entry it has not kept."""

    def __init__(self, spec: GymSpec) -> None:
        self.spec = spec
        self.__name__ = spec.task  # the name the reward is logged under
        self._entries: dict[tuple[int, int, int], dict[str, Any]] = {}
        self._datasets: dict[tuple[int, int], Any] = {}

    def __getstate__(self) -> dict[str, Any]:  # a pickled copy regenerates what it needs
        return self.__dict__ | {"_entries": {}, "_datasets": {}}

    def remember(self, src: int, seed: int, idx: int, entry: dict[str, Any]) -> None:
        self._entries[(src, seed, idx)] = entry

    def _generator(self, src: int, seed: int):
        key = (src, seed)
        if key not in self._datasets:
            self._datasets[key] = _dataset(self.spec.sources[src], seed, 1)
        return self._datasets[key]

    def entry(self, src: int, seed: int, idx: int) -> dict[str, Any]:
        key = (src, seed, idx)
        if key not in self._entries:
            self._entries[key] = self._generator(src, seed)[idx]
        return self._entries[key]

    def score(self, completion: Any, src: int, seed: int, idx: int) -> tuple[float, str | None, str | None]:
        """(score, the extracted answer, why score_answer failed or None)."""
        answer = extract_answer(_text(completion), self.spec.options)
        try:
            value = float(self._generator(src, seed).score_answer(answer, self.entry(src, seed, idx)))
        except Exception as exc:  # noqa: BLE001 - a generator's scorer choking on model output scores 0
            return 0.0, answer, f"{type(exc).__name__}: {exc}"
        return value, answer, None

    def __call__(self, prompts: list[Any], completions: list[Any], rg_source: list[int], rg_seed: list[int],
                 rg_index: list[int], log_extra=None, **_: Any) -> list[float]:
        scored = [self.score(c, s, seed, i)
                  for c, s, seed, i in zip(completions, rg_source, rg_seed, rg_index, strict=True)]
        if log_extra is not None:
            log_extra("extracted_answer", [answer for _, answer, _ in scored])
            if any(err for _, _, err in scored):
                log_extra("score_error", [err for _, _, err in scored])
        return [value for value, _, _ in scored]

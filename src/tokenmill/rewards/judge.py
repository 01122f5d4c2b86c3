"""LLM-as-judge rewards: another model, behind any OpenAI-compatible endpoint, scores the completions.

Two modes, as in TRL's judges and verifiers' `JudgeRubric`:

* `rubric`: one request per completion ("grade this response against the rubric"); the reply's score is read
  from a `<score>7</score>` tag, a reply that is only a number, or a reply starting with yes / no, and
  scaled from `score_range` to [0, 1] (yes 1, no 0).
* `pairwise`: completions are compared two at a time and each gets its win rate (a win 1, a tie 1/2): against
  the reference answer of its row (`reference_column`), or round-robin against the other completions of its
  group (the consecutive completions of one prompt). `both_orders` asks each pair both ways round, which
  cancels a judge's preference for the first (or second) position.

Requests go out concurrently (at most `concurrency` at a time, for the whole reward), each under `timeout_s`,
retried `retries` times with exponential backoff (`backoff_s`, doubling) after a timeout, a connection error,
a 408/409/429 or a 5xx; any other status is not retried. An answered request is cached by what was asked
(model, messages, sampling): the same prompt, completion and rubric are never asked twice (in memory; with
`cache_path` also in a JSONL file, read back by a resumed run); identical requests of one batch are sent once.

A sample the judge could not score (no answer after the retries, a reply with no score) abstains: None, "does
not apply", so it adds nothing to its sample's total and the run goes on. Each batch's counts go to the step's
metrics through `log_metric` (`reward_metric/<name>/requests`, `retries`, `failed`, `unparsed`, `cache_hits`)
and the failures to events.jsonl (`reward_failed`). When the endpoint answers no request for `alarm_after`
batches in a row, a `judge_down` alarm (policy warn) is written to events.jsonl and the console. A dead
endpoint costs little: a batch whose first `concurrency` requests all fail (after their retries) before any
is answered asks no more, and once the alarm is raised each batch first sends one request and, if that fails
too, skips the rest.

Scoring runs on an event loop of the reward's own (one background thread), so `__call__` works from any
thread, inside a running loop too; `ascore` is the coroutine. In an asynchronous run rewards are scored on the
rollout side (the producer thread), so the trainer never waits for the judge.

    >>> judge = JudgeReward("http://127.0.0.1:8000/v1", "judge", rubric="Is the answer correct?")  # doctest: +SKIP
    >>> judge(["2+2="], ["4"], {})                                                 # doctest: +SKIP
    [RewardResult(value=0.9, error=None)]
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import string
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.rewards.base import CallLog, RewardState, is_conversational
from tokenmill.rewards.set import report_failures
from tokenmill.tracking import events
from tokenmill.types import RewardResult

INSTALL = "the judge reward needs the openai package: pip install tokenmill[judge]"
RUBRIC_PROMPT = (
    "Grade the response to the question against the rubric.\n\nQuestion:\n{question}\n\nResponse:\n{completion}"
    "\n\nRubric:\n{rubric}\n\nReply with a score from {low} to {high} in score tags, for example <score>{high}"
    "</score>."
)
PAIRWISE_PROMPT = (
    "Which response answers the question better?\n\nQuestion:\n{question}\n\nResponse A:\n{a}\n\nResponse B:\n"
    "{b}\n\nCriteria:\n{rubric}\n\nReply with A or B in winner tags, for example <winner>A</winner>, or "
    "<winner>tie</winner> if neither is better."
)
FIELDS = {"rubric": {"question", "completion", "rubric", "reference", "low", "high"},
          "pairwise": {"question", "a", "b", "rubric"}}
RETRY_STATUSES = frozenset({408, 409, 429})
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_SCORE_TAG = re.compile(r"<score>\s*([-+]?\d+(?:\.\d+)?)\s*</score>", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_WINNER_TAG = re.compile(r"<winner>\s*(a|b|tie)\s*</winner>", re.IGNORECASE)
_FIRST_WORD = re.compile(r"[A-Za-z]+")


def template_fields(template: str) -> set[str]:
    """The `{field}` names a prompt template uses."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


def _answer_text(reply: str) -> str:
    """The reply without a reasoning model's `<think>...</think>` part."""
    return _THINK.sub("", reply).strip()


def parse_score(
    reply: str, score_range: tuple[float, float] = (0.0, 10.0), pattern: str | None = None
) -> float | None:
    """The score a judge's reply gives, scaled from `score_range` to [0, 1]: the number in `<score>` tags, a
    reply that is only a number, or yes (1) / no (0) as the reply's first word; with `pattern`, its first
    group. None when the reply has none, or a number outside the range."""
    text = _answer_text(reply)
    if pattern is not None:
        found = re.search(pattern, text, re.DOTALL)
        number = found.group(1) if found else None
    else:
        tag = _SCORE_TAG.search(text)
        number = tag.group(1) if tag else (text if _NUMBER.fullmatch(text) else None)
        if number is None:
            word = _FIRST_WORD.match(text)
            verdict = word.group(0).lower() if word else ""
            return 1.0 if verdict == "yes" else 0.0 if verdict == "no" else None
    try:
        value = float(number) if number is not None else None
    except ValueError:
        return None
    low, high = score_range
    if value is None or not low <= value <= high:
        return None
    return (value - low) / (high - low)


def parse_winner(reply: str) -> float | None:
    """Response A's points from a pairwise reply: 1 (A wins), 0 (B wins), 0.5 (a tie); None when it names
    none. Read from `<winner>` tags, else the reply's first word (A, B or tie)."""
    text = _answer_text(reply)
    tag = _WINNER_TAG.search(text)
    word = tag.group(1) if tag else (m.group(0) if (m := _FIRST_WORD.match(text)) else "")
    return {"a": 1.0, "b": 0.0, "tie": 0.5}.get(word.lower())


def question_text(prompt: Any) -> str:
    """The question as the judge reads it: a text prompt as it is; a chat prompt's single message's text, or
    its messages as `role: content` lines."""
    if not is_conversational(prompt):
        return str(prompt)
    if len(prompt) == 1:
        return str(prompt[0].get("content", ""))
    return "\n".join(f"{m.get('role')}: {m.get('content', '')}" for m in prompt)


def prompt_groups(prompts: Sequence[Any], columns: dict[str, list[Any]]) -> list[list[int]]:
    """The indices of each group: runs of consecutive samples with the same prompt and row values (a
    rollout batch lists a prompt's completions together)."""
    groups: list[list[int]] = []
    last: Any = object()
    for i, prompt in enumerate(prompts):
        key = (json.dumps(prompt, sort_keys=True, default=str),
               json.dumps({k: v[i] for k, v in columns.items()}, sort_keys=True, default=str))
        if key != last:
            groups.append([])
            last = key
        groups[-1].append(i)
    return groups


class JudgeCache:
    """Answered requests: key -> the judge's reply, in memory and, with `path`, appended to a JSONL file that a
    later run reads back (lines it cannot read are skipped)."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.replies: dict[str, str] = {}
        self.path = Path(path) if path is not None else None
        self._file = None
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                for line in self.path.read_text(encoding="utf-8").splitlines():
                    try:
                        row = json.loads(line)
                        self.replies[str(row["key"])] = str(row["reply"])
                    except (ValueError, KeyError, TypeError):
                        continue  # a line cut short by a crash
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    @staticmethod
    def key(request: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()

    def get(self, key: str) -> str | None:
        return self.replies.get(key)

    def put(self, key: str, reply: str) -> None:
        with self._lock:
            self.replies[key] = reply
            if self._file is not None and not self._file.closed:
                self._file.write(json.dumps({"key": key, "reply": reply}) + "\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()


@dataclass
class BatchCounts:
    """One batch's requests: sent (each try counts), retries, failed (no answer), cache hits, unparsed replies."""

    requests: int = 0
    retries: int = 0
    failed: int = 0
    cache_hits: int = 0
    unparsed: int = 0
    answered: int = 0
    first_error: str = ""  # why the batch's first failed request failed


def _retryable(exc: BaseException) -> bool:
    import openai

    if isinstance(exc, (asyncio.TimeoutError, openai.APITimeoutError, openai.APIConnectionError)):
        return True
    status = getattr(exc, "status_code", None)
    return isinstance(status, int) and (status in RETRY_STATUSES or status >= 500)


def _describe(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return f"no answer within {timeout_s:g}s"
    status = getattr(exc, "status_code", None)
    text = " ".join(str(exc).split())[:200] or type(exc).__name__
    return f"HTTP {status}: {text}" if status is not None else f"{type(exc).__name__}: {text}"


# one sample's comparisons: (request key, side) with side None (rubric), "a" or "b" (its place in a pair)
Asks = list[tuple[str, str | None]]


class JudgeReward:
    """A reward scored by a judge model at `url` (an OpenAI-compatible `/v1` base URL) named `model`; the
    module docstring describes the modes, the requests and what a failure does. `prompt` replaces the mode's
    template (fields: rubric {question} {completion} {rubric} {reference} {low} {high}; pairwise {question}
    {a} {b} {rubric}); `system` adds a system message; `say` prints the alarm's console line."""

    def __init__(
        self, url: str, model: str, *, name: str = "judge", weight: float = 1.0, mode: str = "rubric",
        rubric: str = "", prompt: str | None = None, system: str | None = None, reference_column: str | None = None,
        both_orders: bool = True, score_range: tuple[float, float] = (0.0, 10.0), score_pattern: str | None = None,
        concurrency: int = 8, timeout_s: float = 30.0, retries: int = 2, backoff_s: float = 0.5,
        max_tokens: int = 512, temperature: float = 0.0, api_key: str | None = None, cache: bool = True,
        cache_path: str | Path | None = None, alarm_after: int = 3, say: Callable[[str], None] = print,
    ) -> None:
        try:
            import openai  # noqa: F401 - fail here, with the extra to install, not at the first batch
        except ImportError:
            raise ImportError(INSTALL) from None
        if mode not in FIELDS:
            raise ValueError(f"mode: must be rubric or pairwise, got {mode!r}")
        self.prompt = prompt if prompt is not None else (RUBRIC_PROMPT if mode == "rubric" else PAIRWISE_PROMPT)
        unknown = template_fields(self.prompt) - FIELDS[mode]
        if unknown:
            raise ValueError(f"prompt: unknown field(s) {sorted(unknown)}; a {mode} prompt may use "
                             f"{', '.join('{' + f + '}' for f in sorted(FIELDS[mode]))}")
        if score_pattern is not None:
            try:
                re.compile(score_pattern)
            except re.error as exc:
                raise ValueError(f"score_pattern: not a regular expression: {exc}") from None
        self.url, self.model, self.name, self.weight, self.mode = url, model, name, weight, mode
        self.rubric, self.system, self.reference_column = rubric, system, reference_column
        self.both_orders, self.score_range, self.score_pattern = both_orders, tuple(score_range), score_pattern
        self.concurrency, self.timeout_s, self.retries, self.backoff_s = concurrency, timeout_s, retries, backoff_s
        self.max_tokens, self.temperature, self.api_key = max_tokens, temperature, api_key
        self.cache = JudgeCache(cache_path) if cache else None
        self.alarm_after, self.say = alarm_after, say
        self.last_log = CallLog()
        self.down_batches = 0  # consecutive batches in which the endpoint answered no request
        self.alarms: list[str] = []  # the messages of the alarms raised, in order
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self._semaphore: asyncio.Semaphore | None = None
        self._start_lock = threading.Lock()

    # ------------------------------------------------------------------------------ the Reward protocol
    def __call__(
        self, prompts: list[Any], completions: list[str], columns: dict[str, list[Any]], *,
        completion_ids: list[list[int]] | None = None, state: RewardState | None = None,
    ) -> list[RewardResult]:
        """Score a batch, waiting for the judge on the reward's own event loop (any calling thread). A fault
        of the judge's own (not the endpoint's) fails the batch's samples, naming it, instead of raising."""
        step = state.global_step if state is not None else 0
        future = asyncio.run_coroutine_threadsafe(self._score(prompts, completions, columns, step), self._started())
        try:
            return future.result()
        except Exception as exc:  # noqa: BLE001 - a reward's errors are data (RewardResult.error)
            error = f"judge {self.name!r}: {type(exc).__name__}: {exc}"
            return [RewardResult(None, error) for _ in completions]

    async def ascore(
        self, prompts: list[Any], completions: list[str], columns: dict[str, list[Any]] | None = None, *,
        step: int = 0,
    ) -> list[RewardResult]:
        """`__call__` as a coroutine: awaits the judge without blocking the caller's event loop."""
        future = asyncio.run_coroutine_threadsafe(self._score(prompts, completions, columns or {}, step),
                                                  self._started())
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        """Stop the event loop and its HTTP client; close the cache file. Idempotent."""
        with self._start_lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            if self._client is not None:
                asyncio.run_coroutine_threadsafe(self._client.close(), loop).result(timeout=10)
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=10)
            loop.close()
        if self.cache is not None:
            self.cache.close()

    def _started(self) -> asyncio.AbstractEventLoop:
        """The reward's event loop, started in a daemon thread on first use with the client in it."""
        with self._start_lock:
            if self._loop is None:
                from openai import AsyncOpenAI

                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=loop.run_forever, name=f"judge-{self.name}", daemon=True)
                self._thread.start()

                async def setup() -> None:
                    self._semaphore = asyncio.Semaphore(self.concurrency)
                    self._client = AsyncOpenAI(base_url=self.url, api_key=self.api_key or "EMPTY",
                                               timeout=self.timeout_s, max_retries=0)

                asyncio.run_coroutine_threadsafe(setup(), loop).result()
                self._loop = loop
            return self._loop

    # ------------------------------------------------------------------------------ what is asked
    def _request(self, content: str) -> dict[str, Any]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return {"model": self.model, "messages": [*system, {"role": "user", "content": content}],
                "max_tokens": self.max_tokens, "temperature": self.temperature}

    def _asks(self, prompts: list[Any], completions: list[str], columns: dict[str, list[Any]],
              requests: dict[str, dict[str, Any]]) -> list[Asks]:
        """Each sample's comparisons; the requests they need are added to `requests` (key -> request)."""

        def ask(**fields: Any) -> str:
            request = self._request(self.prompt.format(rubric=self.rubric, **fields))
            key = JudgeCache.key(request)
            requests[key] = request
            return key

        refs = columns[self.reference_column] if self.reference_column else None
        questions = [question_text(p) for p in prompts]
        if self.mode == "rubric":
            low, high = (f"{v:g}" for v in self.score_range)
            return [[(ask(question=q, completion=c, reference="" if refs is None else str(refs[i]), low=low,
                          high=high), None)] for i, (q, c) in enumerate(zip(questions, completions, strict=True))]
        asks: list[Asks] = [[] for _ in completions]
        groups = prompt_groups(prompts, columns)
        pairs = ([(i, None) for i in range(len(completions))] if refs is not None else
                 [(i, j) for group in groups for n, i in enumerate(group) for j in group[n + 1:]])
        for i, j in pairs:
            other = str(refs[i]) if j is None else completions[j]  # type: ignore[index]
            orders = [(completions[i], other, "a")] + ([(other, completions[i], "b")] if self.both_orders else [])
            for a, b, side in orders:
                key = ask(question=questions[i], a=a, b=b)
                asks[i].append((key, side))
                if j is not None:
                    asks[j].append((key, "b" if side == "a" else "a"))
        return asks

    # ------------------------------------------------------------------------------ asking
    async def _score(self, prompts, completions, columns, step: int) -> list[RewardResult]:
        if self.reference_column and self.reference_column not in columns:
            error = f"judge {self.name!r}: no column {self.reference_column!r} (reference_column) in {sorted(columns)}"
            return [RewardResult(None, error) for _ in completions]
        counts = BatchCounts()
        requests: dict[str, dict[str, Any]] = {}
        asks = self._asks(prompts, completions, columns, requests)
        replies, failures = await self._ask_all(requests, counts)
        results, failed = [], []
        for sample in asks:
            value, why = self._value(sample, replies, failures)
            results.append(RewardResult(value))
            failed.append(RewardResult(None, why) if value is None and why else RewardResult(value))
        counts.unparsed = sum(self._read(reply) is None for reply in replies.values())
        self._after(counts, step, failed, failures)
        return results

    def _read(self, reply: str) -> float | None:
        if self.mode == "rubric":
            return parse_score(reply, self.score_range, self.score_pattern)
        return parse_winner(reply)

    def _value(self, sample: Asks, replies: dict[str, str], failures: dict[str, str]) -> tuple[float | None, str]:
        """A sample's score (its mean points over the comparisons the judge answered) or None and why."""
        points, why = [], ""
        for key, side in sample:
            if key in failures:
                why = why or f"judge {self.name!r}: {failures[key]}"
                continue
            read = self._read(replies[key])
            if read is None:
                why = why or f"judge {self.name!r}: no {'score' if self.mode == 'rubric' else 'winner'} in its " \
                             f"reply {replies[key]!r:.120}"
            else:
                points.append(1.0 - read if side == "b" else read)
        return (sum(points) / len(points) if points else None), why

    async def _ask_all(
        self, requests: dict[str, dict[str, Any]], counts: BatchCounts
    ) -> tuple[dict[str, str], dict[str, str]]:
        """Replies (key -> text) from the cache or the endpoint, and failures (key -> why)."""
        replies: dict[str, str] = {}
        todo = []
        for key, request in requests.items():
            cached = self.cache.get(key) if self.cache is not None else None
            if cached is not None:
                replies[key] = cached
                counts.cache_hits += 1
            else:
                todo.append((key, request))
        failures: dict[str, str] = {}
        if todo and self.down_batches >= self.alarm_after:  # down for a while: one request first
            key, request = todo.pop(0)
            await self._ask(key, request, counts, replies, failures)
            if key in failures:
                skipped = f"not asked: the endpoint is down ({failures[key]})"
                failures.update({k: skipped for k, _ in todo})
                counts.failed += len(todo)
                todo = []
        await asyncio.gather(*(self._ask(key, request, counts, replies, failures) for key, request in todo))
        return replies, failures

    async def _ask(self, key: str, request: dict[str, Any], counts: BatchCounts, replies: dict[str, str],
                   failures: dict[str, str]) -> None:
        """One request, retried with backoff; its reply is cached and put in `replies`, or its failure in
        `failures`."""
        assert self._semaphore is not None
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                counts.retries += 1
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._semaphore:
                    if counts.answered == 0 and counts.failed >= self.concurrency:  # a whole wave got nothing
                        counts.failed += 1
                        failures[key] = (f"not asked: the first {self.concurrency} requests of this batch got no "
                                         f"answer ({counts.first_error})")
                        return
                    counts.requests += 1
                    answer = await asyncio.wait_for(self._client.chat.completions.create(**request), self.timeout_s)
                reply = answer.choices[0].message.content or ""
            except Exception as exc:  # noqa: BLE001 - every failure is counted and the sample abstains
                last = exc
                if _retryable(exc):
                    continue
                break
            counts.answered += 1
            replies[key] = reply
            if self.cache is not None:
                self.cache.put(key, reply)
            return
        counts.failed += 1
        failures[key] = _describe(last, self.timeout_s) if last is not None else "no answer"
        counts.first_error = counts.first_error or failures[key]

    # ------------------------------------------------------------------------------ reporting
    def _after(self, counts: BatchCounts, step: int, failed: list[RewardResult], failures: dict[str, str]) -> None:
        """The batch's counts as metrics, its failures as a `reward_failed` event, and the endpoint-down alarm."""
        self.last_log = CallLog()
        for field in ("requests", "retries", "failed", "unparsed", "cache_hits"):
            self.last_log.log_metric(f"{self.name}/{field}", getattr(counts, field))
        report_failures(self.name, failed, step)
        if counts.answered or not counts.failed:
            if self.down_batches >= self.alarm_after and counts.answered:
                self.say(f"judge {self.name!r} at {self.url} answers again")
            self.down_batches = 0
            return
        self.down_batches += 1
        if self.down_batches == self.alarm_after:
            self._alarm(step, counts, next(iter(failures.values())))

    def _alarm(self, step: int, counts: BatchCounts, error: str) -> None:
        """The `judge_down` alarm: an `alarm` row in events.jsonl (the shape `health.alarms` writes) and a
        console line; the run goes on, the judge's samples abstaining."""
        message = (f"judge {self.name!r} at {self.url} answered no request in {self.down_batches} consecutive "
                   f"batches (last error: {error}); its samples abstain and the run goes on without it; each "
                   "batch now sends one request first. Check that the endpoint is up (the reward's url, model "
                   "and api_key_env)")
        self.alarms.append(message)
        events.emit("alarm", name="judge_down", metric=f"reward_metric/{self.name}/failed",
                    value=float(counts.failed), threshold=float(self.alarm_after), policy="warn", message=message,
                    step=step)
        self.say(f"alarm (warn) judge_down: {message}")

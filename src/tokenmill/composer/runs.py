"""Runs launched from the Composer: a `tokenmill train|sft|preference` subprocess per run folder, and the
files it leaves, read back as a list and as a resumable event stream.

The trainer never talks to the UI: it appends to `metrics.jsonl` / `samples.jsonl` / `events.jsonl` (a line
per stage entered) and prints to `log.txt`. We tail those files by byte offset; the offsets are the event cursor, so a reconnecting client resumes
exactly (no line twice, none lost), and a run that ended, or that outlived a Composer restart, reopens from
its files alone. Runs are started as an argv list in their own session (never through a shell), so stop
signals the whole process group.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tokenmill.composer.configs import RewardCode, code_reward_entries, export_yaml, validate
from tokenmill.config.modes import MODES
from tokenmill.config.safe_yaml import load_yaml_text
from tokenmill.types import TokenmillError

FINAL = ("finished", "failed", "stopped")
LABELS = "labels.json"  # a run's name and tags, set from the Runs page
STREAMS = ("metrics", "samples", "log", "events")  # the cursor's four offsets, in this order
FILES = {"metrics": "metrics.jsonl", "samples": "samples.jsonl", "log": "log.txt", "events": "events.jsonl"}
SSE_NAMES = {"metrics": "metrics", "samples": "samples", "log": "log", "events": "stage"}
EVENT_KINDS = {"alarm": "alarm", "efficiency_report": "efficiency"}  # events.jsonl kinds -> SSE event names
STAGE_ORDER = ("generate", "reward", "critic", "train", "sync")
STOP_GRACE_S = 25.0  # above checkpoint.preempt_timeout_s (20 s): a stopped run saves its checkpoint first
DEFAULT_MAX_RUNS = 1  # one training run already takes every core of a workstation (torch threads)
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_DEPTH = 3  # run folders are found this deep under runs_dir (runs/<sweep>/<group>/<run>)
MAX_SWEEP = 16  # runs one sweep may queue
_MAX_LINES_PER_READ = 2000  # bounds one poll's work on a huge backlog; the next poll reads on


class RunError(TokenmillError):
    """A request about runs that cannot be served; `status` is the HTTP status to answer with and `details`
    extra keys of the JSON error body."""

    def __init__(self, status: int, message: str, **details: Any) -> None:
        super().__init__(message)
        self.status = status
        self.details = details


@dataclass(frozen=True)
class Cursor:
    """Byte offsets read so far in metrics.jsonl, samples.jsonl, log.txt and events.jsonl."""

    metrics: int = 0
    samples: int = 0
    log: int = 0
    events: int = 0

    def __str__(self) -> str:
        return f"{self.metrics}.{self.samples}.{self.log}.{self.events}"

    @classmethod
    def parse(cls, text: str | None) -> Cursor:
        if not text:
            return cls()
        parts = text.strip().split(".")
        # three parts: an id from before events.jsonl was tailed (its stage lines are then sent from the start)
        if len(parts) not in (3, 4) or not all(p.isdigit() for p in parts):
            raise RunError(400, "Last-Event-ID: expected '<metrics>.<samples>.<log>.<events>' byte offsets, "
                                f"got {text!r:.60}")
        return cls(*(int(p) for p in parts))


def read_lines(path: Path, offset: int, limit: int = _MAX_LINES_PER_READ) -> list[tuple[str, int]]:
    """Whole lines of `path` from byte `offset`, each with the offset just after it; a line still being
    written (no newline yet) is left for the next read."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(4 << 20)
    except FileNotFoundError:
        return []
    out = []
    pos = 0
    while len(out) < limit:
        end = data.find(b"\n", pos)
        if end < 0:
            break
        out.append((data[pos:end].decode("utf-8", "replace"), offset + end + 1))
        pos = end + 1
    return out


def read_events(run_dir: Path, cursor: Cursor) -> tuple[list[tuple[str, str, str]], Cursor]:
    """New (event, data, id) triples since `cursor`, and the cursor after them."""
    events: list[tuple[str, str, str]] = []
    offsets = {stream: getattr(cursor, stream) for stream in STREAMS}
    for stream in STREAMS:
        for line, end in read_lines(run_dir / FILES[stream], offsets[stream]):
            offsets[stream] = end
            if stream == "log":
                data = json.dumps({"line": line})
            elif not line.strip():
                continue
            else:
                data = line  # already one JSON object per line
            name = SSE_NAMES[stream] if stream != "events" else _event_name(line)
            if name is None:
                continue  # a kind of event the page does not show
            events.append((name, data, str(Cursor(**offsets))))
    return events, Cursor(**offsets)


def _event_name(line: str) -> str | None:
    """The SSE event an events.jsonl line is sent as: a stage entered, a health alarm, an efficiency report."""
    if _stage_record(line) is not None:
        return "stage"
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return EVENT_KINDS.get(row.get("event")) if isinstance(row, dict) else None


def _tail(path: Path, size: int) -> bytes:
    """The last `size` bytes of `path` (empty when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read()
    except FileNotFoundError:
        return b""


def _stage_record(line: str | bytes) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if isinstance(row, dict) and row.get("event") == "stage" and isinstance(row.get("stage"), str):
        return row
    return None


def reported_stages(run_dir: Path, since: float | None = None) -> list[dict[str, Any]]:
    """The last stage line of each side in events.jsonl (the trainer's report), newest first; lines older
    than `since` (an earlier launch of a resumed run folder) do not count."""
    found: dict[Any, dict[str, Any]] = {}
    for line in reversed(_tail(run_dir / FILES["events"], 16 << 10).splitlines()):
        row = _stage_record(line)
        if row is None or row.get("side") in found:
            continue
        if since is not None and isinstance(row.get("t"), (int, float)) and row["t"] < since:
            break
        found[row.get("side")] = row
        if len(found) == 3:  # no side, producer, trainer
            break
    return list(found.values())


def _is_eval(row: dict[str, Any]) -> bool:
    """A held-out evaluation row (logged at step 0 and after the last step) rather than a training step's."""
    return "reward/mean" not in row and any(str(k).startswith("eval/") for k in row)


def last_metrics(run_dir: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The last training row and the last evaluation row of metrics.jsonl (read from the end: runs can log
    many thousand rows). A finished run's very last row is its final evaluation, which has no reward."""
    tail = _tail(run_dir / FILES["metrics"], 256 << 10)
    train = evaluation = None
    for line in reversed(tail.splitlines()):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict):
            continue
        if _is_eval(row):
            evaluation = evaluation or row
        else:
            train = train or row
        if train is not None and evaluation is not None:
            break
    return train, evaluation


def estimate_stage(row: dict[str, Any] | None, seconds_since: float) -> str:
    """The stage a running step is most likely in: the previous step's stage timings laid end to end in
    loop order, at the time elapsed since that step was logged (modulo one step)."""
    if not row:
        return "starting"
    timings = [(s, float(row[f"timing_s/{s}"])) for s in STAGE_ORDER if isinstance(row.get(f"timing_s/{s}"), (int, float))]
    total = sum(t for _, t in timings)
    if total <= 0:
        return "generate"
    at = seconds_since % total
    for name, seconds in timings:
        if at < seconds:
            return name
        at -= seconds
    return timings[-1][0]


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"tokenmill" in f.read()  # not some other process that got the pid later
    except OSError:
        return False


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


class RunManager:
    """Launch, stop, list and tail the runs under `runs_dir` (one folder each). At most `max_runs` run at
    once, counting runs an earlier Composer launched into the same folder that are still alive."""

    def __init__(self, runs_dir: str | Path, max_runs: int = DEFAULT_MAX_RUNS) -> None:
        if max_runs < 1:
            raise ValueError(f"max_runs: must be at least 1 (got {max_runs})")
        self.runs_dir = Path(runs_dir).expanduser().resolve()
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.max_runs = max_runs
        self._procs: dict[str, subprocess.Popen] = {}
        self._stopping: set[str] = set()
        self._lock = threading.Lock()
        self._launching = threading.Lock()  # the cap's count and the launch it allows are one step

    # ------------------------------------------------------------------------------ launch / stop
    def folder(self, run_id: str) -> Path:
        """The folder of `run_id`: a path under `runs_dir` of at most MAX_DEPTH names ("sweep/lr-1e-5")."""
        parts = run_id.split("/")
        if len(parts) > MAX_DEPTH or not all(_ID.match(p) and p not in (".", "..") for p in parts):
            raise RunError(404, f"run {run_id!r}: not a run id")
        path = self.runs_dir.joinpath(*parts)
        if not path.is_dir():
            raise RunError(404, f"run {run_id!r}: no such run in {self.runs_dir}")
        return path

    def _new_id(self, mode: str, name: str | None) -> str:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        label = re.sub(r"[^A-Za-z0-9_-]+", "-", name or mode).strip("-")[:40] or mode
        return f"{stamp}-{label}-{secrets.token_hex(2)}"

    def prepare(self, mode: str, config: dict[str, Any], rewards: list[RewardCode], run_dir: Path) -> BaseModel:
        """The config to launch: code rewards written to `run_dir/rewards/` and referenced by file path,
        outputs pointed into the run folder. Raises RunError(422) naming the field if it is invalid."""
        tree = json.loads(json.dumps(config))  # a deep copy we may edit
        try:
            entries = code_reward_entries(mode, rewards, str(run_dir / "rewards"))
        except ValueError as exc:
            raise RunError(422, str(exc)) from None
        if rewards and isinstance(tree.get("rewards", []), list):  # else the schema names the bad field
            (run_dir / "rewards").mkdir(parents=True, exist_ok=True)
            for r in rewards:
                (run_dir / "rewards" / f"{r.name}.py").write_text(r.code)
            tree["rewards"] = [*tree.get("rewards", []), *entries]
        if mode == "rl":
            tree.setdefault("tracking", {})
            tree["tracking"] = {**tree["tracking"], "output_dir": str(run_dir), "console": "plain"}
        else:
            tree["output_dir"] = str(run_dir / "model")
        cfg, errors = validate(mode, tree)
        if cfg is None:
            raise RunError(422, "; ".join(f"{e['path']}: {e['message']}" for e in errors))
        return cfg

    def running(self) -> list[str]:
        """Ids of the runs under `runs_dir` that are running now."""
        return [r["id"] for r in self.list() if r["status"] == "running"]

    def launch(self, mode: str, config: dict[str, Any], rewards: list[RewardCode] | None = None,
               name: str | None = None, *, queue: bool = False, tags: list[str] | None = None) -> dict[str, Any]:
        """Start a run; when `max_runs` are running already, RunError 409 (with the running ids), or with
        `queue` the run is written and waits ("queued", started in launch order as runs end)."""
        if mode not in MODES:
            raise RunError(400, f"mode: unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        with self._launching:
            running = self.running()
            if len(running) >= self.max_runs and not queue:
                raise RunError(409, f"runs: {len(running)} run(s) already running, the most this Composer "
                               f"starts at once (--max-runs {self.max_runs}); stop one or wait for it to end: "
                               f"{', '.join(running)}", running=running, max_runs=self.max_runs)
            now = len(running) < self.max_runs and not self.queued()
            run_id, meta = self._create(mode, config, rewards or [], name, tags, queued=not now)
            if now:
                return self._start(run_id, meta)
            position = len(self.queued())
        self.start_queued()
        return {"id": run_id, "output_dir": str(self.runs_dir / run_id), "status": "queued", "position": position}

    def sweep(self, mode: str, config: dict[str, Any], rewards: list[RewardCode], field: str, values: list[Any]
              ) -> dict[str, Any]:
        """One run per value of the dotted `field`, all queued (they start as slots free up) and tagged
        `sweep:<time>`; every config is validated before any run is written (RunError 422 names the value)."""
        if not 2 <= len(values) <= MAX_SWEEP:
            raise RunError(422, f"values: sweep 2 to {MAX_SWEEP} values (got {len(values)})")
        configs = [_with(config, field, v) for v in values]
        for value, tree in zip(values, configs, strict=True):
            _, errors = validate(mode, tree)
            if errors:
                raise RunError(422, f"{field} = {value!r}: " + "; ".join(f"{e['path']}: {e['message']}" for e in errors))
        tag = "sweep:" + time.strftime("%H%M%S")
        leaf = field.rsplit(".", 1)[-1]
        runs = [self.launch(mode, tree, rewards, f"{leaf}={value}", queue=True, tags=[tag])
                for value, tree in zip(values, configs, strict=True)]
        return {"tag": tag, "runs": runs}

    def resume(self, run_id: str, *, queue: bool = False) -> dict[str, Any]:
        """Launch an ended run again in its own folder with `checkpoint.resume: true`: it continues from its
        newest complete checkpoint (the same files grow). RunError 409 while it runs or has no checkpoint."""
        from tokenmill.checkpoint import list_checkpoints

        run_dir = self.folder(run_id)
        info = self.describe(run_id)
        if info["status"] in ("running", "queued"):
            raise RunError(409, f"run {run_id!r}: it is {info['status']}; stop it first")
        if not any(list_checkpoints(d / "checkpoints") for d in (run_dir, run_dir / "model")):
            raise RunError(409, f"run {run_id!r}: no complete checkpoint to resume from (checkpoint.every saves "
                                "them during a run; a stopped run saves one)")
        tree = load_yaml_text((run_dir / "run.yaml").read_text()) or {}
        mode = tree.pop("mode", info["mode"])
        tree["checkpoint"] = {**(tree.get("checkpoint") or {}), "resume": True}
        cfg, errors = validate(mode, tree)
        if cfg is None:
            raise RunError(422, "; ".join(f"{e['path']}: {e['message']}" for e in errors))
        with self._launching:
            running = self.running()
            if len(running) >= self.max_runs and not queue:
                raise RunError(409, f"runs: {len(running)} run(s) already running (--max-runs {self.max_runs}): "
                               f"{', '.join(running)}", running=running, max_runs=self.max_runs)
            (run_dir / "run.yaml").write_text(export_yaml(mode, cfg))
            (run_dir / "status.json").unlink(missing_ok=True)
            meta = {k: v for k, v in _read_json(run_dir / "composer.json").items() if k not in ("pid", "argv")}
            meta = {**meta, "mode": mode, "total_steps": _total_steps(cfg)}
            if len(running) < self.max_runs and not self.queued():
                return self._start(run_id, meta)
            _write_json(run_dir / "composer.json", {**meta, "queued": time.time()})
        self.start_queued()
        return {"id": run_id, "output_dir": str(run_dir), "status": "queued"}

    def queued(self) -> list[str]:
        """Ids of the runs waiting for a free slot, oldest first."""
        waiting = [(meta.get("queued", 0), path.relative_to(self.runs_dir).as_posix())
                   for path in _run_folders(self.runs_dir)
                   if (meta := _read_json(path / "composer.json")).get("queued") and "pid" not in meta
                   and not (path / "status.json").exists()]
        return [run_id for _, run_id in sorted(waiting)]

    def start_queued(self) -> list[str]:
        """Start queued runs, oldest first, while fewer than `max_runs` run; the ids started."""
        started = []
        with self._launching:
            waiting = self.queued()
            free = self.max_runs - len(self.running())
            for run_id in waiting[:max(free, 0)]:
                self._start(run_id)
                started.append(run_id)
        return started

    def _create(self, mode: str, config: dict[str, Any], rewards: list[RewardCode], name: str | None,
                tags: list[str] | None, *, queued: bool) -> tuple[str, dict[str, Any]]:
        """The run's folder with its run.yaml, and its composer.json's first keys (written now when it waits:
        no pid yet)."""
        run_id = self._new_id(mode, name)
        run_dir = self.runs_dir / run_id
        run_dir.mkdir(parents=True)
        try:
            cfg = self.prepare(mode, config, rewards, run_dir)
        except RunError:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        (run_dir / "run.yaml").write_text(export_yaml(mode, cfg))
        if tags:
            _write_json(run_dir / LABELS, {"name": name, "tags": tags})
        meta = {"id": run_id, "mode": mode, "output_dir": str(run_dir), "total_steps": _total_steps(cfg)}
        if queued:
            meta["queued"] = time.time()
            _write_json(run_dir / "composer.json", meta)
        return run_id, meta

    def _start(self, run_id: str, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        run_dir = self.runs_dir / run_id
        meta = meta if meta is not None else _read_json(run_dir / "composer.json")
        config_path = run_dir / "run.yaml"
        argv = [sys.executable, "-m", "tokenmill.cli", MODES[meta["mode"]].command, str(config_path)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("TOKENMILL_COMPOSER_TOKEN", None)  # the run does not need the Composer's secret
        with open(run_dir / FILES["log"], "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        _write_json(run_dir / "composer.json", {**meta, "argv": argv, "pid": proc.pid, "started": time.time()})
        with self._lock:
            self._procs[run_id] = proc
        threading.Thread(target=self._wait, args=(run_id, proc, run_dir), daemon=True,
                         name=f"composer-run-{run_id}").start()
        return {"id": run_id, "argv": argv, "output_dir": str(run_dir), "status": "running"}

    def _ended(self, run_id: str, code: int) -> dict[str, Any]:
        status = "stopped" if run_id in self._stopping else ("finished" if code == 0 else "failed")
        return {"status": status, "returncode": code, "ended": time.time()}

    def _wait(self, run_id: str, proc: subprocess.Popen, run_dir: Path) -> None:
        code = proc.wait()
        _write_json(run_dir / "status.json", self._ended(run_id, code))
        with self._lock:
            self._procs.pop(run_id, None)
        self.start_queued()  # a slot is free: the oldest queued run starts

    def stop(self, run_id: str) -> dict[str, Any]:
        """SIGINT to the run's trainer (it closes cleanly), then SIGKILL to what is left of its process group
        once it has exited, or after STOP_GRACE_S."""
        run_dir = self.folder(run_id)
        info = self.describe(run_id)
        if info["status"] == "queued":  # it never started: it leaves the queue
            with self._launching:
                _write_json(run_dir / "status.json", {"status": "stopped", "returncode": None, "ended": time.time()})
            return {"id": run_id, "status": "stopped"}
        if info["status"] != "running":
            return {"id": run_id, "status": info["status"]}
        pid = _read_json(run_dir / "composer.json").get("pid")
        self._stopping.add(run_id)
        proc = self._procs.get(run_id)
        # SIGINT to the trainer alone: it closes its reward workers itself (a Ctrl-C in each of them would
        # print a KeyboardInterrupt traceback into the log); whatever is left of the group is killed after
        _signal(pid, signal.SIGINT)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and _alive(proc, pid):
            time.sleep(0.1)
        _signal_group(pid, signal.SIGKILL)
        if proc is not None:
            proc.wait(timeout=STOP_GRACE_S)
            deadline = time.monotonic() + 5
            while not (run_dir / "status.json").exists() and time.monotonic() < deadline:
                time.sleep(0.02)  # the waiter thread writes it
        else:  # launched by an earlier Composer process: nobody else will record the end
            _write_json(run_dir / "status.json", {"status": "stopped", "returncode": None, "ended": time.time()})
        return {"id": run_id, "status": self.describe(run_id)["status"]}

    # ------------------------------------------------------------------------------ read back
    def describe(self, run_id: str) -> dict[str, Any]:
        run_dir = self.folder(run_id)
        meta = _read_json(run_dir / "composer.json")
        final = _read_json(run_dir / "status.json")
        row, evaluation = last_metrics(run_dir)
        proc = self._procs.get(run_id)
        if final.get("status") not in FINAL and proc is not None and proc.poll() is not None:
            final = self._ended(run_id, proc.returncode)  # exited; the waiter thread has not written it yet
        if final.get("status") in FINAL:
            status = final["status"]
        elif meta.get("queued") and "pid" not in meta:  # waiting for a free slot
            status = "queued"
        elif meta:  # not alive and no status.json: it ended while no Composer was watching it
            status = "running" if _alive(proc, meta.get("pid")) else "failed"
        else:  # a folder written by `tokenmill train` itself
            status = "finished" if (run_dir / "final").is_dir() else "unknown"
        started = meta.get("started", meta.get("queued", _mtime(run_dir, "config.yaml")))
        ended = final.get("ended") or (None if status == "running" else _mtime(run_dir, FILES["metrics"]))
        labels = _read_json(run_dir / LABELS)
        return {
            "id": run_id, "mode": meta.get("mode", "rl"), "status": status, "returncode": final.get("returncode"),
            "name": labels.get("name"), "tags": labels.get("tags", []), "archived": bool(labels.get("archived")),
            "duration_s": round((ended or time.time()) - started, 1) if started else None,
            "started": started, "ended": ended,
            "step": row.get("step") if row else None, "total_steps": meta.get("total_steps"),
            "output_dir": str(run_dir), "argv": meta.get("argv"), "last_metrics": row, "last_eval": evaluation,
        }

    def list(self) -> list[dict[str, Any]]:
        out = [self.describe(path.relative_to(self.runs_dir).as_posix()) for path in _run_folders(self.runs_dir)]
        return sorted(out, key=lambda r: r["started"] or 0, reverse=True)

    def status_event(self, run_id: str) -> dict[str, Any]:
        info = self.describe(run_id)
        row = info["last_metrics"]
        running = info["status"] == "running"
        out = {"status": info["status"], "mode": info["mode"], "returncode": info["returncode"], "step": info["step"],
               "total_steps": info["total_steps"], "stage": None, "stage_step": None, "stage_source": None,
               "sides": {}, "bottleneck": row.get("bottleneck") if row else None}
        if not running:
            return out
        reported = reported_stages(self.runs_dir / run_id, since=info["started"])
        if reported:  # the trainer's own report: the newest stage entered, and each async side's
            out |= {"stage": reported[0]["stage"], "stage_step": reported[0].get("step"),
                    "stage_source": "reported",
                    "sides": {r["side"]: r["stage"] for r in reported if isinstance(r.get("side"), str)}}
        else:  # a trainer that writes no events.jsonl (older tokenmill): guess from the last step's timings
            since = time.time() - _mtime(self.runs_dir / run_id, FILES["metrics"]) if row else 0.0
            out |= {"stage": estimate_stage(row, since), "stage_source": "estimated"}
        return out

    def close(self) -> None:
        """Leave running runs alone (they outlive the Composer, like `nohup`); only forget them."""
        with self._lock:
            self._procs.clear()


def _with(config: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    """A deep copy of `config` with the dotted `field` set to `value` (sections made as needed)."""
    tree = json.loads(json.dumps(config))
    node = tree
    *parents, leaf = field.split(".")
    for key in parents:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[leaf] = value
    return tree


def _run_folders(folder: Path, depth: int = MAX_DEPTH) -> list[Path]:
    """Run folders (a composer.json or a metrics.jsonl inside) under `folder`, looking `depth` levels down;
    a run folder's own subfolders (checkpoints, rewards) are not searched."""
    found = []
    for path in sorted(folder.iterdir()):
        if not path.is_dir() or not _ID.match(path.name):
            continue
        if (path / "composer.json").exists() or (path / FILES["metrics"]).exists():
            found.append(path)
        elif depth > 1:
            found.extend(_run_folders(path, depth - 1))
    return found


def _alive(proc: subprocess.Popen | None, pid: int | None) -> bool:
    """Our child (launched by this Composer) or, after a restart, the pid recorded in composer.json."""
    return proc.poll() is None if proc is not None else _pid_alive(pid)


def _signal(pid: int | None, sig: int) -> None:
    if not pid:
        return
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pid: int | None, sig: int) -> None:
    if not pid:
        return
    try:
        os.killpg(pid, sig)  # start_new_session: the run's pid is its process group id
    except (ProcessLookupError, PermissionError):
        pass


def _mtime(folder: Path, name: str) -> float | None:
    try:
        return (folder / name).stat().st_mtime
    except OSError:
        return None


def _total_steps(cfg: BaseModel) -> int | None:
    controller = getattr(cfg, "controller", None)
    return controller.steps if controller is not None else getattr(cfg, "steps", None)

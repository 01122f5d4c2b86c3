"""The Composer's web server: a FastAPI app over the config schema, the reward preview, the memory estimate and
the run folders. Routes and shapes: `API.md` beside this file.

Security (docs/reliability.md): the server binds loopback unless told otherwise, and every request, the page
included, needs the token printed at start (an HttpOnly SameSite=Strict cookie set by `/?token=`, or a bearer
header). Before the token, the `Host` header must name this server (a DNS-rebinding page would send its own
name); state-changing requests from another origin are refused (CSRF). Reward code runs only in forked
workers with a timeout (`preview.py`), runs only as argv-list subprocesses (`runs.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gzip
import hashlib
import json
import mimetypes
import re
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill import serving
from tokenmill.composer import compare, configs
from tokenmill.composer.placement import placement_answer
from tokenmill.composer.presets import presets
from tokenmill.composer.preview import REWARD_MODEL_TIMEOUT_S, Previewer, PreviewError
from tokenmill.composer.runs import DEFAULT_MAX_RUNS, FINAL, Cursor, RunError, RunManager, read_events
from tokenmill.composer.schema_ui import schema_response
from tokenmill.composer.trial import Trial, sources
from tokenmill.config.modes import MODES
from tokenmill.estimate import estimate_for_config
from tokenmill.serving import ExposureError, host_name, is_loopback
from tokenmill.serving_limits import ConnectionLimits
from tokenmill.types import ConfigError

__all__ = ["ExposureError", "create_app", "host_name", "is_loopback", "serve"]

STATIC_DIR = Path(__file__).parent / "static"
COOKIE = "tm_token"
POLL_S = 0.25
KEEPALIVE_S = 15.0


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


# ------------------------------------------------------------------------------------------ request bodies
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ConfigBody(_Body):
    mode: str = Field("rl", description="rl | preference | reward_model | sft")
    config: dict[str, Any] = Field(default_factory=dict)


class EstimateBody(ConfigBody):
    device_memory_gib: float | None = Field(None, gt=0)
    num_devices: int = Field(1, ge=1, le=4096)


class ExportBody(ConfigBody):
    rewards: list[configs.RewardCode] = Field(default_factory=list, max_length=32)


class PageReward(BaseModel):
    """A reward of the page, named only (its draft may still be unfinished)."""

    name: str = Field("", max_length=200)
    function: str = Field("", max_length=200)


class ImportBody(_Body):
    yaml: str = Field(..., max_length=1_000_000)
    mode: str | None = None
    rewards: list[PageReward] = Field(default_factory=list, max_length=32,
                                      description="The page's code rewards (their exported entries are dropped "
                                                  "from the imported config)")


class PreviewBody(ConfigBody):
    rewards: list[configs.RewardCode] = Field(default_factory=list, max_length=32)
    prompts: int = Field(4, ge=1, le=16)
    samples: int = Field(4, ge=1, le=16)
    seed: int = 0
    reward_model_timeout_s: float = Field(REWARD_MODEL_TIMEOUT_S, gt=0, le=3600,
                                          description="Seconds a reward model may take to load, then to score.")


class RunBody(ConfigBody):
    rewards: list[configs.RewardCode] = Field(default_factory=list, max_length=32)
    name: str | None = Field(None, max_length=64)
    queue: bool = Field(False, description="At --max-runs: wait for a free slot (202, status queued) instead of 409")


class SweepBody(ConfigBody):
    rewards: list[configs.RewardCode] = Field(default_factory=list, max_length=32)
    field: str = Field(..., pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$", max_length=200)
    values: list[Any] = Field(..., min_length=2, max_length=16)


class TryBody(_Body):
    prompt: str = Field(..., min_length=1, max_length=20_000)
    max_tokens: int = Field(64, ge=1, le=512)
    source: str = Field("final", pattern=r"^(final|step_[0-9]+)$",
                        description="The run's model to ask: final (its result) or a checkpoint (step_<n>)")


class ExportModelBody(_Body):
    source: str = Field("final", pattern=r"^(final|step_[0-9]+)$")


class LabelsBody(_Body):
    name: str | None = Field(None, max_length=200)
    tags: list[str] = Field(default_factory=list, max_length=16)
    archived: bool | None = Field(None, description="Hide the run from the Runs page's default view (None: keep)")


def _mode(mode: str) -> str:
    if mode not in MODES:
        raise RunError(400, f"mode: unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    return mode


def _valid(body: ConfigBody) -> Any:
    """The body's config object; invalid -> 422 with the field errors."""
    cfg, errors = configs.validate(_mode(body.mode), body.config)
    if cfg is None:
        raise _Invalid(errors)
    return cfg


class _Invalid(Exception):
    def __init__(self, errors: list[dict[str, str]]) -> None:
        super().__init__("invalid config")
        self.errors = errors


def create_app(token: str, runs_dir: str | Path = "runs/composer", *, bind_host: str = "127.0.0.1",
               static_dir: str | Path | None = None, max_runs: int = DEFAULT_MAX_RUNS,
               max_body_bytes: int = serving.DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The Composer app, with its Guard installed; `bind_host` decides which Host headers it answers,
    `max_runs` how many launched runs may run at once, `max_body_bytes` the largest request body (413)."""
    if not token:
        raise ValueError("token must be a non-empty string")
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        app.state.trial.servers.close()  # the `tokenmill serve` processes of Try stop with the Composer

    app = FastAPI(title="tokenmill composer", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.runs = RunManager(runs_dir, max_runs=max_runs)
    app.state.previewer = Previewer()
    app.state.trial = Trial()
    static = Path(static_dir) if static_dir is not None else STATIC_DIR
    # every route needs the token (the page too: it is set as a cookie by `/?token=`); refusals in our shape
    serving.Guard.install(app, token=token, allowed_hosts=serving.host_set(serving.bind_names(bind_host)),
                          open_paths=(), cookie=COOKIE, error=lambda status, message, _param: _error(status, message),
                          max_body_bytes=max_body_bytes)
    # JSON answers over 1 KB travel gzipped (the schema: 70 KB -> about 8 KB); the event stream never is
    app.add_middleware(GZipMiddleware, minimum_size=1024, compresslevel=6)
    _errors(app)
    _page_routes(app, static)
    _config_routes(app)
    _trial_routes(app)  # before the run routes: `/api/runs/{id}` would take `/api/runs/{id}/models`
    _run_routes(app)
    return app


def _errors(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"path": ".".join(str(p) for p in e["loc"]), "message": e["msg"]} for e in exc.errors()]
        first = errors[0] if errors else {"path": "body", "message": "invalid"}
        return _error(422, f"{request.url.path}: {first['path']}: {first['message']}", errors=errors)

    @app.exception_handler(RunError)
    async def run_error(request: Request, exc: RunError) -> JSONResponse:
        return _error(exc.status, str(exc), **exc.details)

    @app.exception_handler(_Invalid)
    async def invalid(request: Request, exc: _Invalid) -> JSONResponse:
        first = exc.errors[0]
        return _error(422, f"invalid config: {first['path']}: {first['message']}", errors=exc.errors)

    @app.exception_handler(PreviewError)
    async def preview_error(request: Request, exc: PreviewError) -> JSONResponse:
        return _error(422, f"preview: {exc}", errors=exc.errors)


def _page_routes(app: FastAPI, static: Path) -> None:
    @app.get("/", response_model=None)
    async def index(request: Request) -> Response:
        page = static / "index.html"
        if not page.is_file():
            return _error(503, f"the Composer front end is not built: {page} is missing (build it with "
                               "`node build.mjs` in src/tokenmill/composer/frontend); the API under /api works")
        body = _versioned_index(static)
        tag = f'"{hashlib.sha256(body).hexdigest()[:20]}"'
        if request.headers.get("if-none-match") == tag:
            return Response(status_code=304, headers={"ETag": tag, "Cache-Control": "no-cache"})
        return Response(body, media_type="text/html; charset=utf-8", headers={"ETag": tag, "Cache-Control": "no-cache"})

    @app.get("/static/{name:path}", response_model=None)
    async def static_file(name: str, request: Request, v: str | None = None) -> Response:
        root = static.resolve()
        path = (root / name).resolve()
        if root not in path.parents or not path.is_file():
            return _error(404, f"GET /static/{name}: no such file")
        digest = _digest(path)
        gz = "gzip" in request.headers.get("accept-encoding", "")
        tag = f'"{digest}{"-gz" if gz else ""}"'
        # the page asks for /static/app.js?v=<its content hash>: that address never changes content, so the
        # browser keeps it for a year without asking; any other address is revalidated by its ETag
        headers = {"ETag": tag, "Vary": "Accept-Encoding",
                   "Cache-Control": "public, max-age=31536000, immutable" if v == digest else "no-cache"}
        if tag in request.headers.get("if-none-match", ""):
            return Response(status_code=304, headers=headers)
        if not gz:
            return FileResponse(path, headers=headers)
        body, media_type = _gzipped(path)  # the bundle: 589 KB of JS, 200 KB gzipped
        return Response(body, media_type=media_type, headers={**headers, "Content-Encoding": "gzip"})


def _digest(path: Path) -> str:
    stat = path.stat()
    return _digest_cached(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _digest_cached(path: Path, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


@functools.lru_cache(maxsize=16)
def _gzipped_cached(path: Path, mtime_ns: int, size: int) -> tuple[bytes, str]:
    media_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return gzip.compress(path.read_bytes(), compresslevel=6, mtime=0), media_type


def _gzipped(path: Path) -> tuple[bytes, str]:
    """The file gzipped once per version of it (a rebuilt bundle is compressed again)."""
    stat = path.stat()
    return _gzipped_cached(path, stat.st_mtime_ns, stat.st_size)


def _versioned_index(static: Path) -> bytes:
    """index.html with each /static/ address given its file's content hash (`/static/app.js?v=<hash>`), so a
    rebuilt bundle is a new address and an unchanged one is never fetched again."""
    html = (static / "index.html").read_text()

    def version(match: re.Match) -> str:
        path = static / match.group(2)
        return f'{match.group(1)}/static/{match.group(2)}?v={_digest(path)}"' if path.is_file() else match.group(0)

    return re.sub(r'((?:src|href)=")/static/([A-Za-z0-9_.-]+)"', version, html).encode()


def _config_routes(app: FastAPI) -> None:
    @app.get("/api/schema")
    def schema(mode: str = "rl") -> dict[str, Any]:
        return schema_response(_mode(mode))

    @app.get("/api/presets")
    def preset_list(mode: str = "rl") -> list[dict[str, Any]]:
        return presets(_mode(mode))

    @app.post("/api/validate")
    def validate(body: ConfigBody) -> dict[str, Any]:
        cfg, errors = configs.validate(_mode(body.mode), body.config)
        return {"ok": cfg is not None, "errors": errors, "config": configs.normalized(cfg) if cfg else None}

    @app.post("/api/diagram")
    def diagram(body: ConfigBody) -> dict[str, Any]:
        return configs.diagram_for(_mode(body.mode), body.config)

    @app.post("/api/yaml/export")
    def export(body: ExportBody) -> dict[str, Any]:
        """The YAML, and the page's code rewards as files beside it (`rewards/<name>.py`, referenced relative
        to the folder the command runs in)."""
        try:
            entries = configs.code_reward_entries(_mode(body.mode), body.rewards, "rewards")
        except ValueError as exc:
            raise RunError(422, str(exc)) from None
        given = body.config.get("rewards", [])
        config = {**body.config, "rewards": [*given, *entries]} if entries and isinstance(given, list) else body.config
        cfg = _valid(ConfigBody(mode=body.mode, config=config))
        name = configs.config_filename(body.mode)
        files = [{"path": f"rewards/{r.name}.py", "content": r.code} for r in body.rewards]
        return {"yaml": configs.export_yaml(body.mode, cfg), "filename": name, "files": files,
                "command": configs.command_for(body.mode, name)}

    @app.post("/api/yaml/import")
    def import_(body: ImportBody) -> dict[str, Any]:
        return configs.import_yaml(body.yaml, _mode(body.mode) if body.mode else None,
                                   [(r.name, r.function) for r in body.rewards])

    @app.post("/api/estimate")
    def estimate(body: EstimateBody) -> dict[str, Any]:
        cfg = _valid(body)
        config = {**configs.normalized(cfg), "mode": body.mode}
        return estimate_for_config(config, device_memory_gib=body.device_memory_gib, num_devices=body.num_devices)

    @app.post("/api/placement")
    def placement(body: ConfigBody) -> dict[str, Any]:
        return placement_answer(body.mode, _valid(body))

    @app.post("/api/rewards/preview")
    def preview(body: PreviewBody) -> dict[str, Any]:
        if body.mode != "rl":
            raise RunError(400, f"mode: the reward preview is for mode rl, not {body.mode!r}")
        cfg = _valid(body)
        return app.state.previewer.preview(cfg, body.rewards, prompts=body.prompts, samples=body.samples,
                                           seed=body.seed, reward_model_timeout_s=body.reward_model_timeout_s)


def _trial_routes(app: FastAPI) -> None:
    """Try the result and export it (`trial.py`)."""
    runs: RunManager = app.state.runs

    @app.post("/api/runs/{run_id:path}/try")
    def try_result(run_id: str, body: TryBody) -> dict[str, Any]:
        """The run's result and its base model answer one prompt (greedy), side by side."""
        model = compare.run_config(runs.folder(run_id)).get("model")
        base = model.get("path") if isinstance(model, dict) else None
        try:
            return app.state.trial.compare(runs, run_id, base, body.prompt, body.max_tokens, body.source)
        except ConfigError as exc:
            raise RunError(422, f"run {run_id!r}: {exc}") from None

    @app.get("/api/runs/{run_id:path}/models")
    def models(run_id: str) -> dict[str, Any]:
        """What the run can be tried or exported from (final, each checkpoint), and the servers up now."""
        return {"sources": sources(runs.folder(run_id)), "servers": app.state.trial.servers.alive()}

    @app.post("/api/runs/{run_id:path}/export")
    def export_model(run_id: str, body: ExportModelBody) -> dict[str, Any]:
        """The run's final model or a checkpoint as a plain HF folder (LoRA adapters merged): its path."""
        return app.state.trial.export(runs, run_id, body.source)


def _run_routes(app: FastAPI) -> None:
    runs: RunManager = app.state.runs

    @app.post("/api/runs", status_code=201, response_model=None)
    def launch(body: RunBody) -> dict[str, Any] | JSONResponse:
        _valid(body)  # field errors as a list before anything is written
        run = runs.launch(body.mode, body.config, body.rewards, name=body.name, queue=body.queue)
        return JSONResponse(run, status_code=202) if run["status"] == "queued" else run

    @app.post("/api/sweep", status_code=202)
    def sweep(body: SweepBody) -> dict[str, Any]:
        _mode(body.mode)
        return runs.sweep(body.mode, body.config, body.rewards, body.field, body.values)

    @app.get("/api/runs")
    def run_list(columns: str = Query("", max_length=2000)) -> dict[str, Any]:
        """Every run; `columns=a.b,c.d` adds each run's value of those config keys (`columns`)."""
        keys = [k for k in columns.split(",") if k][:16]
        listed = runs.list()
        return {"runs": compare.config_columns(listed, keys) if keys else listed, "max_runs": runs.max_runs}

    @app.get("/api/compare")
    def compare_runs(ids: str = Query(..., max_length=2000)) -> dict[str, Any]:
        return compare.compare(runs, [i for i in ids.split(",") if i])

    @app.get("/api/compare/samples")
    def compare_samples(ids: str = Query(..., max_length=2000), prompt: str | None = Query(None, max_length=20_000)
                        ) -> dict[str, Any]:
        return compare.shared_samples(runs, [i for i in ids.split(",") if i], prompt)

    # a run id may be a nested folder ("sweep/a"): the routes that add a suffix come before the bare one
    @app.post("/api/runs/{run_id:path}/stop")
    def stop(run_id: str) -> dict[str, Any]:
        return runs.stop(run_id)

    @app.post("/api/runs/{run_id:path}/resume")
    def resume(run_id: str, queue: int = Query(0, ge=0, le=1)) -> dict[str, Any]:
        return runs.resume(run_id, queue=bool(queue))

    @app.post("/api/runs/{run_id:path}/labels")
    def labels(run_id: str, body: LabelsBody) -> dict[str, Any]:
        return compare.set_labels(runs, run_id, body.name, body.tags, archived=body.archived)

    @app.get("/api/runs/{run_id:path}/clone")
    def clone(run_id: str) -> dict[str, Any]:
        return compare.clone(runs, run_id)

    @app.get("/api/runs/{run_id:path}/report")
    def report(run_id: str) -> dict[str, Any]:
        return compare.efficiency_report(runs, run_id)

    @app.get("/api/runs/{run_id:path}/events")
    async def events(run_id: str, request: Request, follow: int = Query(1, ge=0, le=1),
                     last_event_id: str | None = None) -> StreamingResponse:
        run_dir = runs.folder(run_id)
        cursor = Cursor.parse(request.headers.get("last-event-id") or last_event_id)
        stream = _sse(runs, run_id, run_dir, cursor, bool(follow), request)
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    @app.get("/api/runs/{run_id:path}")
    def run_info(run_id: str) -> dict[str, Any]:
        info = runs.describe(run_id)
        path = runs.folder(run_id) / "run.yaml"
        if not path.exists():
            path = runs.folder(run_id) / "config.yaml"
        info["config"] = configs.import_yaml(path.read_text())["config"] if path.exists() else None
        return info


def _frame(event: str, data: str, event_id: str) -> bytes:
    return f"id: {event_id}\nevent: {event}\ndata: {data}\n\n".encode()


async def _sse(runs: RunManager, run_id: str, run_dir: Path, cursor: Cursor, follow: bool, request: Request):
    """Status first, then every new line of the run's files and a status on each change; once the run has
    ended (or with follow=0, once the backlog is drained) one last read and the final status."""
    status = runs.status_event(run_id)
    yield _frame("status", json.dumps(status), str(cursor))
    last_sent = time.monotonic()
    while True:
        events, cursor = read_events(run_dir, cursor)
        for event, data, event_id in events:
            yield _frame(event, data, event_id)
        if events:
            last_sent = time.monotonic()
            continue  # drain the backlog before looking at the status again
        fresh = runs.status_event(run_id)
        if fresh["status"] in FINAL or fresh["status"] == "unknown" or not follow:
            events, cursor = read_events(run_dir, cursor)  # lines written just before the exit
            if events:
                for event, data, event_id in events:
                    yield _frame(event, data, event_id)
                continue
            yield _frame("status", json.dumps(fresh), str(cursor))
            return
        if fresh != status:
            status = fresh
            yield _frame("status", json.dumps(status), str(cursor))
            last_sent = time.monotonic()
        if await request.is_disconnected():
            return
        if time.monotonic() - last_sent > KEEPALIVE_S:
            last_sent = time.monotonic()
            yield b": keepalive\n\n"
        await asyncio.sleep(POLL_S)


def serve(host: str = "127.0.0.1", port: int = 8600, *, token: str | None = None, allow_remote: bool = False,
          runs_dir: str | Path = "runs/composer", max_runs: int = DEFAULT_MAX_RUNS, say: Any = print,
          limits: ConnectionLimits | None = None) -> None:
    """Bind, print the URL with the token, and serve until interrupted (`limits`: read timeout and
    connection cap)."""
    import secrets

    token = token or secrets.token_urlsafe(24)
    serving.check_exposure(host, token, allow_remote)
    try:
        sock = serving.bind(host, port)
    except ExposureError as exc:
        raise ExposureError(f"--port {port}: {exc}") from None
    app = create_app(token, runs_dir, bind_host=host, max_runs=max_runs)
    url = serving.url_of(host, sock.getsockname()[1])
    say(f"tokenmill composer: open {url}/?token={token}")
    say(f"  runs in {app.state.runs.runs_dir}; "
        f"{'loopback only' if is_loopback(host) else 'REACHABLE FROM THE NETWORK (token required)'}; Ctrl-C stops")
    serving.serve_forever(app, sock, graceful_timeout_s=2, limits=limits)

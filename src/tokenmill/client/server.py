"""`tokenmill serve-trainer MODEL`: the training service over HTTP.

`POST /v1/<op>` with a JSON object of the operation's arguments, for the operations of `TrainerService`
(`create_training_client`, `forward_backward`, `forward`, `optim_step`, `save_state`, `load_state`,
`save_weights_for_sampler`, `create_sampling_client`, `sample`); `GET /v1/info` names the base model. The
shared serving layer (`tokenmill.serving`) binds it (loopback unless allowed), checks Host, Origin, the bearer
token and the body size, and answers every error in OpenAI's shape: a bad request is a 4xx naming its field.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool

from tokenmill import serving
from tokenmill.client.service import RequestError, TrainerService
from tokenmill.serving_limits import ConnectionLimits

OPS = ("create_training_client", "forward_backward", "forward", "optim_step", "save_state", "load_state",
       "save_weights_for_sampler", "create_sampling_client", "sample")
MAX_BODY_BYTES = 256 * 2**20  # a forward_backward carries the whole batch


def create_app(service: TrainerService, *, token: str | None = None, allowed_hosts: tuple[str, ...] = (),
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="tokenmill trainer server", docs_url=None, redoc_url=None, openapi_url=None)
    serving.Guard.install(app, token=token, allowed_hosts=serving.host_set(allowed_hosts),
                          max_body_bytes=max_body_bytes)
    serving.install_openai_errors(app)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/info")
    def info() -> dict[str, Any]:
        return {"base_model": service.base_model, "operations": list(OPS),
                "training_clients": sorted(service.trainees), "sampling_clients": sorted(service.samplers)}

    @app.post("/v1/{op}")
    async def call(op: str, request: Request) -> dict[str, Any]:
        if op not in OPS:
            raise serving.ApiError(404, f"no operation {op!r}; one of {', '.join(OPS)}")
        try:
            body = await request.json()
        except ValueError:
            raise serving.ApiError(400, "the body must be a JSON object") from None
        if not isinstance(body, dict):
            raise serving.ApiError(400, "the body must be a JSON object of the operation's arguments")
        method = getattr(service, op)
        try:
            inspect.signature(method).bind(**body)
        except TypeError as exc:
            params = ", ".join(inspect.signature(method).parameters)
            raise serving.ApiError(400, f"{op}: {exc} (arguments: {params})") from None
        try:
            return await run_in_threadpool(method, **body)
        except RequestError as exc:
            raise serving.ApiError(exc.status, exc.message, exc.param) from None

    return app


def serve(base_model: str, *, host: str = "127.0.0.1", port: int = 8100, token: str | None = None,
          allow_remote: bool = False, root: str = "runs/trainer", device: str = "cpu",
          limits: ConnectionLimits | None = None) -> None:
    """Load `base_model` and serve it until interrupted; prints `serving.ready_line` once it accepts
    connections (port 0 binds a free port). `limits`: read timeout and connection cap."""
    serving.check_exposure(host, token, allow_remote)
    if not Path(base_model, "config.json").is_file():
        raise ValueError(f"MODEL {base_model!r}: not a model folder (no config.json)")
    sock = serving.bind(host, port)
    try:
        service = TrainerService(base_model, root, device=device)
    except (OSError, ValueError) as exc:
        sock.close()
        raise ValueError(f"MODEL {base_model!r}: could not load it: {exc}".splitlines()[0]) from None
    app = create_app(service, token=token, allowed_hosts=serving.bind_names(host))
    url = serving.url_of(host, sock.getsockname()[1])

    def ready() -> None:
        print(serving.ready_line("tokenmill serve-trainer", url, f"auth {'on' if token else 'off'}, states in "
                                 f"{service.root}"), flush=True)

    serving.serve_forever(app, sock, on_ready=ready, limits=limits)

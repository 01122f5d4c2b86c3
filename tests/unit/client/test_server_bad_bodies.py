"""Hostile bodies against `tokenmill serve-trainer`'s routes, on a real loopback server.

Hypothesis generates bodies for every operation: any JSON at all (wrong types, huge and non-finite numbers,
unknown keys, lone surrogates, nesting) must get a success or a 4xx in OpenAI's error shape, never a 5xx; and
bodies that carry one argument known to be bad (beside generated others) must get a 4xx and change nothing: no
adapter weight, no optimiser moment, no client, no file under the server's root. The server stays healthy.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.client import TrainerService
from tokenmill.client.server import OPS, create_app
from tokenmill.serving import start_in_thread
from tokenmill.testing import build_tiny_model
from tokenmill.testing.http import check_error_shape as check

FUZZ = settings(max_examples=100, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path_factory.mktemp("m"), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    service = TrainerService(model, tmp_path_factory.mktemp("root"))
    srv, _ = start_in_thread(create_app(service))
    with httpx.Client(base_url=srv.url, timeout=60) as http:  # kept alive: a bad body must not drop it
        cid = http.post("/v1/create_training_client", json={"rank": 2}).json()["client_id"]
        data = [{"tokens": [5, 9, 11, 12], "advantages": 1.0}]
        assert http.post("/v1/forward_backward", json={"cid": cid, "data": data}).status_code == 200
        assert http.post("/v1/optim_step", json={"cid": cid}).status_code == 200  # AdamW has moments now
        sid = http.post("/v1/create_sampling_client", json={"client_id": cid}).json()["sampler_id"]
        saved = http.post("/v1/save_weights_for_sampler", json={"cid": cid, "name": "w"}).json()["path"]
        yield http, service, {"cid": cid, "sid": sid, "saved": saved, "data": data}
    srv.stop()


def dump(value: Any) -> bytes:
    # surrogatepass: a lone surrogate goes out as JSON's own escape, as a hostile client would send it
    return json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")


def post(http: httpx.Client, op: str, raw: bytes) -> httpx.Response:
    return http.post(f"/v1/{op}", content=raw, headers={"content-type": "application/json"})


# ------------------------------------------------------------------------------------------ strategies
texts = st.text(max_size=10) | st.sampled_from(["\ud800", "a\udfffb", "../x", "t1", "t1-sampler:1"])
numbers = st.sampled_from([0, -1, 1, 2, 2**31, 2**63, 2**70, -(2**70), NAN, INF, -INF]) | st.floats(allow_nan=True)
scalars = st.none() | st.booleans() | numbers | texts
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                      max_leaves=8)
token_lists = st.lists(st.integers(-(2**40), 2**40), max_size=4)
datums = st.fixed_dictionaries({}, optional={"tokens": token_lists | values, "weights": values,
                                             "logprobs": values, "advantages": values | numbers})
ARGS: dict[str, dict[str, st.SearchStrategy]] = {  # each operation's arguments, hostile
    "create_training_client": {"rank": values | st.integers(-5, 2000), "alpha": values, "seed": values,
                               "target_modules": values},
    "forward_backward": {"data": st.lists(datums, max_size=2) | values, "loss_fn": values,
                         "loss_fn_config": values},
    "forward": {"data": st.lists(datums, max_size=2) | values},
    "optim_step": {"adam_params": st.dictionaries(st.sampled_from(["learning_rate", "beta1", "eps", "lr"]), numbers)
                   | values},
    "save_state": {"name": values},
    "load_state": {"path": values},
    "save_weights_for_sampler": {"name": values},
    "create_sampling_client": {"model_path": values, "client_id": values, "seed": values},
    "sample": {"prompts": st.lists(token_lists | values, max_size=2) | values,
               "params": st.fixed_dictionaries({}, optional={"max_tokens": st.sampled_from([0, 1, 2, "2", 2**70]),
                                                             "temperature": numbers, "top_p": numbers,
                                                             "top_k": values, "n": values, "stop": values,
                                                             "greedy": values}) | values},
}
# one argument that makes the request wrong, whatever the others hold (so nothing may change)
POISON: dict[str, dict[str, list[Any]]] = {
    "create_training_client": {"rank": [0, -1, 2000, "8", 2.5, None], "alpha": [NAN, INF, -1.0, 0, "x"],
                               "seed": [-1, 2**64, "s", 1.5, NAN]},
    "forward_backward": {"data": [[], "x", [{"tokens": [1]}], [{"tokens": [1, 2], "advantages": NAN}],
                                  [{"tokens": [1, 10**9]}], [{"tokens": [1, 2], "weights": [1.0]}],
                                  [{"tokens": [1, 2], "logprobs": [0.0, INF]}], [{"tokens": [1, 2], "weights": "x"}]],
                         "loss_fn": ["magic", 3, [1], {"a": 1}]},
    "forward": {"data": [[], None, [{"tokens": [1, -1]}], [{"tokens": [1, 2], "advantages": [NAN, 1.0]}]]},
    "optim_step": {"adam_params": [{"lr": 1}, {"learning_rate": NAN}, {"learning_rate": 0}, {"eps": -1},
                                   {"learning_rate": INF}, "x", [1]], "cid": ["t99", 5, None, [1]]},
    "save_state": {"name": ["../x", "", "a/b", 5, None, "x" * 65]},
    "load_state": {"path": ["/", 5, None, "../", "runs"]},
    "save_weights_for_sampler": {"name": ["../x", "", "a/b", [1], "x" * 65]},
    "create_sampling_client": {"model_path": ["/", "nowhere", 5], "seed": [-1, "s", 2**64]},
    "sample": {"prompts": [[[10**9]], [[]], [], "", [[1, -1]]], "params": [{"max_tokens": 0}, {"temperature": NAN},
                                                                          {"top_p": 0}, {"n": 0}, {"bogus": 1}]},
}


def poisoned(op: str, ids: dict[str, Any]) -> st.SearchStrategy:
    known = dict(ARGS[op])
    if op in ("forward_backward", "forward", "optim_step", "save_state", "load_state", "save_weights_for_sampler"):
        known["cid"] = st.sampled_from([ids["cid"]] * 3 + ["t99", 5, None])  # mostly the real client
    if op == "sample":
        known["sid"] = st.sampled_from([ids["sid"]] * 3 + ["nobody"])
    if op == "create_sampling_client":  # both given: refused, whatever they are
        known["client_id"] = st.sampled_from([ids["cid"], "t99"])
    bad = st.sampled_from([(k, v) for k, vs in POISON[op].items() for v in vs])
    return st.tuples(st.fixed_dictionaries({}, optional=known), bad).map(lambda got: dump({**got[0], got[1][0]: got[1][1]}))


def state(service: TrainerService) -> dict[str, Any]:
    """Everything a request could change: weights, optimiser state, clients and the files under the root."""
    params = {n: p.detach().clone() for n, p in service.model.named_parameters()}
    moments = {cid: json.dumps(t.backend.state_dict()["scheduler"], default=str) for cid, t in service.trainees.items()}
    adam = [v.clone() for t in service.trainees.values() for s in t.backend.optimizer.state.values()
            for v in s.values() if torch.is_tensor(v)]
    files = sorted(str(p) for p in service.root.rglob("*"))
    return {"params": params, "moments": moments, "adam": adam, "files": files,
            "clients": (sorted(service.trainees), sorted(service.samplers), service.count)}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    tensors = a["params"].keys() == b["params"].keys() and all(
        torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    adam = len(a["adam"]) == len(b["adam"]) and all(torch.equal(x, y) for x, y in zip(a["adam"], b["adam"]))
    return tensors and adam and all(a[k] == b[k] for k in ("moments", "files", "clients"))


@pytest.mark.parametrize("op", OPS)
def test_bad_bodies_get_a_4xx_and_change_nothing(server, op):
    http, service, ids = server
    before = state(service)

    @FUZZ
    @given(raw=poisoned(op, ids))
    def run(raw: bytes) -> None:
        answer = post(http, op, raw)
        check(answer)
        assert 400 <= answer.status_code < 500, (raw, answer.text[:300])

    run()
    assert same(before, state(service)), op
    assert http.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize("op", OPS)
def test_any_body_gets_a_success_or_a_4xx_in_one_shape(server, op):
    http, _, _ = server

    @FUZZ
    @given(raw=(st.fixed_dictionaries({}, optional=ARGS[op]) | st.dictionaries(texts, values, max_size=3)
                | values).map(dump))
    def run(raw: bytes) -> None:
        check(post(http, op, raw))

    run()
    for raw, status in ((b"{", 400), (b"\xff\xfe", 400), (b"[]", 400), (b"null", 400)):
        reply = post(http, op, raw)
        check(reply)
        assert reply.status_code == status
    assert http.get("/health").json() == {"status": "ok"}

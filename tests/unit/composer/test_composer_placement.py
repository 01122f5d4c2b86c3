"""`POST /api/placement`: the planner's layout of a Ray cluster config (the same as `tokenmill plan`), its refusal
naming the field, and a plain answer for configs Ray does not place."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tokenmill.composer.app import create_app
from tokenmill.config import RLConfig, load_config
from tokenmill.config.cluster import make_plan, roles_in_use

TOKEN = "t0ken"
RL = {"model": {"path": "some/model"}, "data": {"task": "addition"}, "algorithm": {"kl_coef": 0.05}}
CLUSTER = {"backend": "ray", "nodes": 2, "cpus_per_node": 2, "trainer_ranks": 2, "engine_replicas": 1,
           "roles": {"reference": {"placement": "own"}}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    app = create_app(TOKEN, tmp_path_factory.mktemp("runs"))
    with TestClient(app, base_url="http://127.0.0.1", headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


def test_the_layout_is_the_plan_of_tokenmill_plan(client):
    answer = client.post("/api/placement", json={"mode": "rl", "config": RL | {"cluster": CLUSTER}})
    assert answer.status_code == 200
    body = answer.json()
    cfg = load_config(RLConfig, RL | {"cluster": CLUSTER})
    plan = make_plan(cfg.cluster, roles_in_use(cfg))
    assert body["backend"] == "ray" and body["lines"] == plan.lines()
    assert [[(s["name"], s["device"]) for s in n["slots"]] for n in body["layout"]["nodes"]] == [
        [("trainer rank 0", "cpu"), ("trainer rank 1", "cpu")], [("reference rank 0", "cpu"), ("engine replica 0", "cpu")]]
    assert body["layout"]["roles"][1] == {"role": "reference",
                                          "where": "a worker group of its own: reference rank 0 (FSDP2 over 1)"}


def test_a_layout_that_does_not_fit_is_answered_with_the_planners_message(client):
    crowded = CLUSTER | {"engine_replicas": 2}
    answer = client.post("/api/placement", json={"mode": "rl", "config": RL | {"cluster": crowded}})
    assert answer.status_code == 200
    assert answer.json() == {"backend": "ray", "error": (
        "cluster: engine replica 1 does not fit: after the trainer ranks, the nodes have CPU 0, GPU 0; CPU 0, GPU 0 "
        "left, a replica needs CPU 1, GPU 0")}
    # the memory estimate still answers, with the refusal among its warnings
    known = RL | {"model": {"path": "Qwen/Qwen2.5-0.5B"}, "cluster": crowded}  # a built-in shape
    estimate = client.post("/api/estimate", json={"mode": "rl", "config": known})
    assert estimate.status_code == 200 and "placement" not in estimate.json()
    assert "placement: cluster: engine replica 1 does not fit" in " ".join(estimate.json()["warnings"])


def test_a_config_ray_does_not_place_gets_a_plain_answer(client):
    assert client.post("/api/placement", json={"mode": "rl", "config": RL}).json()["backend"] == "local"
    bad = client.post("/api/placement", json={"mode": "rl", "config": RL | {"cluster": CLUSTER | {
        "roles": {"critic": {"placement": "anywhere"}}}}})
    assert bad.status_code == 422
    assert "cluster.roles.critic.placement" in bad.json()["error"]

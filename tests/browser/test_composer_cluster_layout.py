"""The Models page draws where a Ray cluster config runs each role (nodes, devices, roles placed off the driver)
beside the memory estimate, from the planner `tokenmill plan` prints; a layout that does not fit shows the
planner's message naming the field."""

from __future__ import annotations

import pytest
import yaml

expect = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)").expect

CLUSTER = {"backend": "ray", "nodes": 2, "cpus_per_node": 4, "gpus_per_node": 4, "trainer_ranks": 4,
           "engine_replicas": 1,
           "roles": {"reference": {"placement": "with_trainer"}, "critic": {"placement": "own", "ranks": 2}}}


def _import(page, tree: dict) -> None:
    page.get_by_test_id("yaml-input").fill(yaml.safe_dump(tree))
    page.get_by_test_id("import-yaml").click()
    expect(page.get_by_test_id("validation-status")).to_have_text("valid")


def test_the_models_page_shows_each_role_per_node_and_device(page, tiny_model_path, shots):
    from tokenmill.config import RLConfig, load_config
    from tokenmill.config.cluster import make_plan, roles_in_use

    tree = {"mode": "rl", "model": {"path": tiny_model_path}, "data": {"task": "addition"},
            "algorithm": {"advantage": "gae", "kl_coef": 0.05}, "cluster": CLUSTER}
    _import(page, tree)
    with page.expect_response(lambda r: r.url.endswith("/api/placement")) as answer:
        page.get_by_test_id("nav-models").click()
    layout = answer.value.json()["layout"]
    expect(page.get_by_test_id("memory")).to_be_visible()  # the estimate, and beside it the layout
    expect(page.get_by_test_id("cluster-layout")).to_be_visible()

    cfg = load_config(RLConfig, {k: v for k, v in tree.items() if k != "mode"})
    plan = make_plan(cfg.cluster, roles_in_use(cfg))  # what `tokenmill plan` prints for the same config
    for node in (0, 1):
        card = page.get_by_test_id(f"cluster-node-{node}")
        shown = [(s.get_attribute("data-role"), s.get_attribute("data-device"))
                 for s in card.get_by_test_id("cluster-slot").all()]
        want = [(s.role, s.device) for s in sorted(plan.slots, key=lambda s: (s.role != "trainer", s.role, s.index))
                if s.node == node]
        assert sorted(shown) == sorted(want), node
    assert [(s.get_attribute("data-role"), s.get_attribute("data-device"))
            for s in page.get_by_test_id("cluster-node-1").get_by_test_id("cluster-slot").all()] == [
        ("critic", "cuda:0"), ("critic", "cuda:1"), ("engine", "cuda:2")]
    expect(page.get_by_test_id("cluster-free-1")).to_have_text("free: CPU 1, GPU 1")
    expect(page.get_by_test_id("cluster-role-reference")).to_contain_text("sharded over trainer ranks 0-3")
    expect(page.get_by_test_id("cluster-role-critic")).to_contain_text("a worker group of its own: critic ranks 0-1")
    assert [r["where"] for r in layout["roles"]] == [where for _, where in plan.role_lines()]
    # two local nodes (address null) with GPUs would share this machine's: the plan's note, shown as a warning
    expect(page.get_by_test_id("cluster-layout-note")).to_contain_text("would share its GPUs")
    page.screenshot(path=str(shots / "models-cluster-layout.png"), full_page=True)

    # one more critic rank than the nodes hold: the planner's refusal, naming the field, in place of the layout
    page.get_by_test_id("nav-compose").click()
    _import(page, tree | {"cluster": CLUSTER | {"roles": {"critic": {"placement": "own", "ranks": 5}}}})
    page.get_by_test_id("nav-models").click()
    expect(page.get_by_test_id("cluster-layout-error")).to_contain_text(
        "cluster.roles.critic: critic rank 4 does not fit")
    expect(page.get_by_test_id("cluster-node-0")).to_have_count(0)
    assert page.problems == [], page.problems


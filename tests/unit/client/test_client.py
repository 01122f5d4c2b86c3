"""The training client on a real tiny model: losses equal hand-computed values, steps move the logprobs the
right way, states round-trip, two adapters on one HTTP server train as they would alone, and bad requests get
OpenAI-shaped 4xx answers naming the field."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from tokenmill.client import AdamParams, Datum, RequestError, SamplingParams, ServiceClient, TrainerService
from tokenmill.client.server import create_app
from tokenmill.serving import start_in_thread
from tokenmill.testing import build_tiny_model

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("m"), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)


@pytest.fixture()
def server(model, tmp_path):
    service = TrainerService(model, tmp_path / "root")
    srv, _ = start_in_thread(create_app(service, token=TOKEN))
    yield srv.url, service
    srv.stop()


DATUM = Datum(tokens=[5, 9, 11, 12, 7], weights=[0.0, 0.0, 1.0, 1.0, 0.5])


def _loop(client, steps: int = 3) -> list[float]:
    """Sample from a snapshot, train on the samples (importance sampling with made-up advantages)."""
    for _ in range(steps):
        got = client.save_weights_and_get_sampling_client().sample([[5, 9, 11]], SamplingParams(max_tokens=3, n=2))
        data = [Datum(tokens=got[0].prompt_ids + s.tokens, weights=[0.0] * 3 + [1.0] * len(s.tokens),
                      logprobs=[0.0] * 3 + s.logprobs, advantages=1.0 - 2 * i) for i, s in enumerate(got[0].sequences)]
        client.forward_backward(data, "importance_sampling")
        client.optim_step(AdamParams(learning_rate=1e-2))
    return client.forward([DATUM])[0]


def test_cross_entropy_equals_hand_value_and_a_step_raises_the_logprobs(model, tmp_path):
    client = ServiceClient(model, root=str(tmp_path)).create_lora_training_client(rank=4, seed=1)
    before = client.forward([DATUM])[0]
    assert len(before) == 5 and before[0] == 0.0
    metrics = client.forward_backward([DATUM], "cross_entropy")
    want = -sum(w * lp for w, lp in zip(DATUM.weights, before))
    assert metrics["loss"] == pytest.approx(want, abs=1e-5)
    # importance sampling at the sampler's own logprobs (ratio 1): loss = -sum w * A
    is_loss = client.forward_backward([Datum(DATUM.tokens, DATUM.weights, before, 0.5)], "importance_sampling")
    assert is_loss["loss"] == pytest.approx(-0.5 * 2.5, abs=1e-5)
    client.optim_step(AdamParams(learning_rate=1e-2))
    after = client.forward([DATUM])[0]
    assert all(a > b for a, b, w in zip(after, before, DATUM.weights) if w)  # both losses push them up
    for _ in range(4):
        client.forward_backward([DATUM], "cross_entropy")
        client.optim_step(AdamParams(learning_rate=1e-2))
    assert client.forward_backward([DATUM], "cross_entropy")["loss"] < metrics["loss"] - 0.05


def test_custom_loss_in_process_and_state_round_trip(model, tmp_path):
    service = ServiceClient(model, root=str(tmp_path))
    client = service.create_lora_training_client(rank=4, seed=2)

    def neg_second_token(logprobs_B_T, batch):  # a loss of one's own on the Batch
        loss = -(logprobs_B_T[:, 2] * (batch.weights_B_T[:, 2] > 0)).sum()
        return loss, {}

    base = client.forward([DATUM])[0]
    client.forward_backward([DATUM], neg_second_token)
    client.optim_step(AdamParams(learning_rate=1e-2))
    saved_lp = client.forward([DATUM])[0]
    assert saved_lp[2] > base[2]
    path = client.save_state("one")
    client.forward_backward([DATUM], "cross_entropy")
    client.optim_step(AdamParams(learning_rate=1e-2))
    assert client.forward([DATUM])[0] != saved_lp
    client.load_state(path)
    assert client.forward([DATUM])[0] == saved_lp
    # sampler weights on disk sample exactly what the in-memory snapshot samples (greedy)
    weights = client.save_weights_for_sampler("w1")
    greedy = SamplingParams(max_tokens=4, greedy=True)
    a = client.save_weights_and_get_sampling_client().sample([[5, 9, 11], [7, 3]], greedy)
    b = service.create_sampling_client(weights).sample([[5, 9, 11], [7, 3]], greedy)
    assert [s.sequences[0].tokens for s in a] == [s.sequences[0].tokens for s in b]


def test_two_adapters_on_one_server_equal_their_solo_runs(model, tmp_path, server):
    solo = [_loop(ServiceClient(model, root=str(tmp_path / f"solo{seed}")).create_lora_training_client(
        rank=4, seed=seed)) for seed in (1, 2)]
    url, _ = server
    shared = ServiceClient(base_url=url, token=TOKEN)
    a, b = shared.create_lora_training_client(rank=4, seed=1), shared.create_lora_training_client(rank=4, seed=2)
    for _ in range(3):  # interleaved, step by step
        _loop(a, 1)
        _loop(b, 1)
    got = [a.forward([DATUM])[0], b.forward([DATUM])[0]]
    for mine, alone in zip(got, solo):
        assert max(abs(x - y) for x, y in zip(mine, alone)) < 1e-6
    assert max(abs(x - y) for x, y in zip(*solo)) > 1e-4  # the two runs differ, so equality means something


def test_bad_requests_get_clear_4xx(server, tmp_path):
    url, _ = server
    client = ServiceClient(base_url=url, token=TOKEN).create_lora_training_client(rank=4)
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"})

    def refused(status: int, op: str, body, param: str | None = None, text: str = "") -> None:
        reply = http.post(f"/v1/{op}", content=body) if isinstance(body, str) else http.post(f"/v1/{op}", json=body)
        assert reply.status_code == status, reply.text
        err = reply.json()["error"]
        assert err["param"] == param and text in err["message"], err

    cid = client.client_id
    assert httpx.post(f"{url}/v1/forward", json={}).status_code == 401  # no token
    refused(404, "train", {}, text="no operation 'train'")
    refused(400, "forward", "not json", text="JSON object")
    refused(400, "forward", [1, 2], text="JSON object")
    refused(400, "forward", {"cid": cid, "data": [], "colour": 1}, text="colour")
    refused(404, "forward", {"cid": "t99", "data": [DATUM.wire()]}, "client_id", "no training client")
    refused(400, "forward_backward", {"cid": cid, "data": [DATUM.wire()], "loss_fn": "magic"}, "loss_fn", "magic")
    refused(400, "forward_backward", {"cid": cid, "data": [DATUM.wire()], "loss_fn": "ppo",
                                      "loss_fn_config": {"clip": 0.1}}, "loss_fn_config", "clip")
    refused(400, "forward", {"cid": cid, "data": [{"tokens": [1, 10**6]}]}, "data.0.tokens", "token ids")
    refused(400, "forward", {"cid": cid, "data": [{"tokens": [1, 2, 3], "weights": [1.0]}]}, "data.0.weights",
            "one number per token (3)")
    refused(400, "optim_step", {"cid": cid, "adam_params": {"lr": 1}}, "adam_params", "unknown key")
    refused(400, "save_state", {"cid": cid, "name": "../up"}, "name")
    refused(404, "load_state", {"cid": cid, "path": str(tmp_path)}, "path", "not a saved folder")
    refused(400, "sample", {"sid": "x", "prompts": [[1]], "params": {"max_tokens": 0}}, "params", "max_tokens")
    old = client.save_weights_and_get_sampling_client()
    client.save_weights_and_get_sampling_client()
    refused(409, "sample", {"sid": old.sampler_id, "prompts": [[1, 2]]}, "sid", "newer")
    with pytest.raises(RequestError, match="newer"):  # the client raises the server's message
        old.sample([[1, 2]])


def test_serve_trainer_refuses_a_bad_folder_and_an_unsafe_bind(tmp_path, capsys, model):
    from tokenmill.cli import main

    assert main(["serve-trainer", str(tmp_path / "nothing")]) == 2
    assert "not a model folder" in capsys.readouterr().err
    assert main(["serve-trainer", model, "--host", "0.0.0.0"]) == 2
    assert "allow-remote" in capsys.readouterr().err


def test_bad_prompts_are_400s_and_the_connection_survives(server):
    url, _ = server
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"})  # one kept-alive connection
    service = ServiceClient(base_url=url, token=TOKEN)
    sampler = service.create_lora_training_client(rank=4).save_weights_and_get_sampling_client()
    for prompts, param in (([[10**9]], "prompts.0"), ([[]], "prompts.0"), ([[5, 9], [3, -1]], "prompts.1")):
        reply = http.post("/v1/sample", json={"sid": sampler.sampler_id, "prompts": prompts})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == param and "token ids" in reply.json()["error"]["message"]
        with pytest.raises(RequestError, match=r"prompts\.\d: token ids must be in \[0, "):
            sampler.sample(prompts)
        got = sampler.sample([[5, 9]], SamplingParams(max_tokens=2))  # the same client goes on
        assert len(got[0].sequences[0].tokens) == 2
    assert http.get("/health").json() == {"status": "ok"}


def test_non_finite_inputs_are_refused_and_the_adapter_is_untouched(server):
    url, _ = server
    client = ServiceClient(base_url=url, token=TOKEN).create_lora_training_client(rank=4, seed=3)
    client.forward_backward([DATUM], "cross_entropy")
    client.optim_step(AdamParams(learning_rate=1e-2))  # B != 0, so every LoRA parameter gets a gradient
    before = client.forward([DATUM])[0]
    nan = float("nan")
    for datum, param in ((Datum(DATUM.tokens, DATUM.weights, before, nan), "data.0.advantages"),
                         (Datum(DATUM.tokens, DATUM.weights, before, [0.0, 1.0, nan, 1.0, 1.0]), "data.0.advantages"),
                         (Datum(DATUM.tokens, [0.0, float("inf"), 1.0, 1.0, 1.0]), "data.0.weights"),
                         (Datum(DATUM.tokens, DATUM.weights, [0.0, nan, 0.0, 0.0, 0.0], 1.0), "data.0.logprobs")):
        with pytest.raises(RequestError, match="finite numbers only") as refused:
            client.forward_backward([datum], "importance_sampling")
        assert refused.value.status == 400 and refused.value.param == param
    with pytest.raises(RequestError, match="loss_fn_config: finite numbers only"):
        client.forward_backward([Datum(DATUM.tokens, DATUM.weights, before, 1.0)], "ppo", {"clip_low": nan})
    for bad in ({"learning_rate": float("inf")}, {"eps": nan}):
        with pytest.raises(RequestError, match="finite"):
            client.optim_step(bad)
    step = client.optim_step(AdamParams(learning_rate=1e-2))  # nothing was accumulated by the refused calls
    assert step["grad_norm"] == 0.0 and "skipped_nonfinite" not in step
    assert client.forward([DATUM])[0] == pytest.approx(before, abs=1e-6)


def test_a_nan_gradient_in_process_is_skipped_not_applied(model, tmp_path):
    client = ServiceClient(model, root=str(tmp_path)).create_lora_training_client(rank=4, seed=4)
    client.forward_backward([DATUM], "cross_entropy")
    client.optim_step(AdamParams(learning_rate=1e-2))
    before = client.forward([DATUM])[0]

    def nan_loss(logprobs_B_T, batch):  # a custom loss gone wrong: the check is the trainer's, not the request's
        return (logprobs_B_T * batch.weights_B_T).sum() * float("nan"), {}

    client.forward_backward([DATUM], nan_loss)
    step = client.optim_step(AdamParams(learning_rate=1e-2))
    assert step["skipped_nonfinite"] == 1 and math.isnan(step["grad_norm"])
    after = client.forward([DATUM])[0]
    assert after == before and all(math.isfinite(x) for x in after)


def test_optim_step_reports_the_learning_rate_it_applied(server):
    url, _ = server
    client = ServiceClient(base_url=url, token=TOKEN).create_lora_training_client(rank=4)
    for lr in (1e-2, 3e-3, 1e-4, 5e-2):
        client.forward_backward([DATUM], "cross_entropy")
        assert client.optim_step(AdamParams(learning_rate=lr))["lr"] == lr


def test_in_process_saves_go_under_the_documented_folder(model, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # a temporary folder would show up here
    (tmp_path / "tmp").mkdir()
    service = ServiceClient(model)
    assert service.root == tmp_path / "runs" / "trainer" and not service.root.exists()  # made by the first save
    client = service.create_lora_training_client(rank=4)
    assert client.save_state("s") == str(tmp_path / "runs/trainer/t1/states/s")
    assert client.save_weights_for_sampler("w") == str(tmp_path / "runs/trainer/t1/sampler_weights/w/t1")
    assert list((tmp_path / "tmp").iterdir()) == []
    given = ServiceClient(model, root=str(tmp_path / "mine"))
    assert given.create_lora_training_client(rank=4).save_state("s").startswith(str(tmp_path / "mine"))

"""`tokenmill validate` (and `train` before any model loads) checks files, columns, devices and references:
one line naming the field, exit 2, no traceback; and it answers fast because it imports no ML library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tokenmill.cli import main
from tokenmill.config import RLConfig, load_config
from tokenmill.config.preflight import check_run, dataset_columns, needed_columns
from tokenmill.types import ConfigError

REWARDS = '''
def needs_answer(prompts, completions, answer, **kwargs):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

def trl_length(completions, **kwargs):
    return [-abs(20 - len(c)) for c in completions]

def with_default(prompts, completions, answer=None, **kwargs):
    return [0.0 for _ in completions]

def one(prompt, completion, answer, **row):
    return float(completion == answer)
'''


def write(tmp_path: Path, tree: dict, name: str = "cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def rows_file(tmp_path: Path, rows: list[dict], name: str = "rows.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def cfg_with(tmp_path: Path, **sections) -> dict:
    tree = {"model": {"path": "org/model"}, "data": {"task": "addition"}}
    tree.update(sections)
    return tree


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    return code, out.out, out.err


# --------------------------------------------------------------------------------------- issue 19.3


def test_validate_rejects_a_group_of_one_with_a_group_baseline(tmp_path, capsys):
    path = write(tmp_path, cfg_with(tmp_path, generation={"group_size": 1}))
    code, out, err = run_cli(["validate", path], capsys)
    assert code == 2 and out == ""
    assert err.splitlines()[1].startswith("generation.group_size: algorithm.advantage 'grpo' compares each")
    assert "set generation.group_size >= 2" in err


def test_validate_rejects_a_missing_data_file(tmp_path, capsys):
    path = write(tmp_path, cfg_with(tmp_path, data={"path": str(tmp_path / "nope.jsonl")}))
    code, _, err = run_cli(["validate", path], capsys)
    assert code == 2
    assert err.splitlines()[1] == (f"data.path: no such file or folder {str(tmp_path / 'nope.jsonl')!r} (a local "
                                   "json/jsonl/csv/parquet file or folder, or a hub dataset name such as org/name)")


def test_a_hub_name_is_not_looked_up(tmp_path, capsys):
    path = write(tmp_path, cfg_with(tmp_path, data={"path": "openai/gsm8k"},
                                    generation={"group_size": 2}))
    code, out, _ = run_cli(["validate", path], capsys)
    assert code == 0
    assert "note: data.path 'openai/gsm8k': columns not checked (not a local file)" in out


HEAVY = ("torch", "transformers", "datasets", "numpy", "pyarrow")


def test_validate_imports_no_ml_library_and_answers_in_under_a_second(tmp_path):
    rows = rows_file(tmp_path, [{"prompt": "1+1=", "answer": "2"}])
    (tmp_path / "rewards.py").write_text(REWARDS)
    path = write(tmp_path, {"model": {"path": "org/model"}, "data": {"path": rows},
                            "rewards": [{"function": f"{tmp_path / 'rewards.py'}:needs_answer"}]})
    probe = ("import sys; from tokenmill.cli import main; code = main(['validate', sys.argv[1]]); "
             f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules]); sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", probe, path], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout and "valid." in done.stdout
    # the installed command, as a user runs it: best of three (the machine may be busy)
    exe = Path(sys.executable).with_name("tokenmill")  # the console script, as a user runs it
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "tokenmill.cli"]
    walls = []
    for _ in range(3):
        start = time.perf_counter()
        done = subprocess.run([*command, "validate", path], check=False, capture_output=True, text=True, timeout=60)
        walls.append(time.perf_counter() - start)
        assert done.returncode == 0, done.stderr
    assert min(walls) < 1.0, walls


# --------------------------------------------------------------------------------------- issue 20.5


def test_dataset_columns_from_the_first_rows(tmp_path):
    assert dataset_columns(rows_file(tmp_path, [{"prompt": "a"}, {"prompt": "b", "answer": "c"}])) == [
        "prompt", "answer"]
    (tmp_path / "rows.csv").write_text("\ufeffquestion,answer\nq,a\n")  # a BOM is not part of the first name
    assert dataset_columns(str(tmp_path / "rows.csv")) == ["question", "answer"]
    (tmp_path / "rows.json").write_text(json.dumps([{"prompt": "p", "solution": "s"}]))
    assert dataset_columns(str(tmp_path / "rows.json")) == ["prompt", "solution"]
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"prompt": ["p"], "label": [1]}).to_parquet(str(tmp_path / "rows.parquet"))
    assert dataset_columns(str(tmp_path / "rows.parquet")) == ["prompt", "label"]
    datasets.Dataset.from_dict({"text": ["p"], "gold": [1]}).save_to_disk(str(tmp_path / "saved"))
    assert dataset_columns(str(tmp_path / "saved")) == ["text", "gold"]


@pytest.mark.parametrize("content, needle", [
    ("", "has no rows"),
    ("\n\n", "has no rows"),
    ('{"prompt": "a"}\n{broken\n', "line 2 is not JSON"),
    ('["a", "b"]\n', "line 1 is a list, not an object of column values"),
    (b'{"prompt": "\xff"}\n', "line 1 is not JSON"),
])
def test_bad_jsonl_is_one_line(tmp_path, content, needle):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError, match=needle) as err:
        dataset_columns(str(path))
    assert str(err.value).startswith("data.path: ") and "\n" not in str(err.value)


def test_needed_columns_follow_trl_keyword_calling(tmp_path):
    namespace: dict = {}
    exec(REWARDS, namespace)  # noqa: S102 - the reward examples of this file
    assert needed_columns(namespace["needs_answer"]) == ["answer"]
    assert needed_columns(namespace["trl_length"]) == []
    assert needed_columns(namespace["with_default"]) == []
    assert needed_columns(namespace["one"], per_sample=True) == ["answer"]


@pytest.mark.parametrize("case, lines", [
    ("no prompt column", ["data.prompt_column: column 'prompt' not in the dataset (columns: question, answer)"]),
    ("reward lacks its column", [("rewards.0.function: needs_answer() needs the dataset column(s) 'answer', which "
                                 "the dataset lacks (columns: prompt); add them or give the parameter a default")]),
    ("per-sample reward lacks its column", [("rewards.0.function: one() needs the dataset column(s) 'answer', "
                                            "which the dataset lacks (columns: prompt); add them or give the "
                                            "parameter a default")]),
    ("folder without config.json", [("model.path: '{tmp}/model' has no config.json, so it is not a Hugging Face "
                                    "model folder")]),
    ("missing local model", ["model.path: no model folder at './no-such-model'"]),
    ("unknown env", [("env.name: unknown environment 'chess'; built-in: guess_number, coding, calculator, gym, or "
                     "'module:Class' / 'path/to/file.py:Class' of your own")]),
    ("missing cuda index", ["model.device: 'cuda:99' but this machine has"]),
])
def test_validate_and_train_reject_before_loading(tmp_path, capsys, case, lines):
    (tmp_path / "rewards.py").write_text(REWARDS)
    reward_file = tmp_path / "rewards.py"
    tree = {"model": {"path": "org/model"}, "data": {"path": rows_file(tmp_path, [{"prompt": "p"}])}}
    if case == "no prompt column":
        tree["data"]["path"] = rows_file(tmp_path, [{"question": "q", "answer": "a"}], "qa.jsonl")
    elif case == "reward lacks its column":
        tree["rewards"] = [{"function": f"{reward_file}:needs_answer"}]
    elif case == "per-sample reward lacks its column":
        tree["rewards"] = [{"function": f"{reward_file}:one", "per_sample": True}]
    elif case == "folder without config.json":
        (tmp_path / "model").mkdir()
        tree["model"]["path"] = str(tmp_path / "model")
    elif case == "missing local model":
        tree["model"]["path"] = "./no-such-model"
    elif case == "unknown env":
        tree["env"] = {"name": "chess"}
    elif case == "missing cuda index":
        tree["model"]["device"] = "cuda:99"
    path = write(tmp_path, tree)
    for command in ("validate", "train"):
        code, out, err = run_cli([command, path], capsys)
        assert code == 2, (command, out, err)
        got = err.splitlines()[1:]
        want = [line.replace("{tmp}", str(tmp_path)) for line in lines]
        assert len(got) == len(want) and all(g.startswith(w) for g, w in zip(got, want)), got


def test_cuda_on_a_machine_without_it(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    path = write(tmp_path, cfg_with(tmp_path, model={"path": "org/model", "device": "cuda"}))
    code, _, err = run_cli(["validate", path], capsys)
    assert code == 2
    assert err.splitlines()[1] == "model.device: 'cuda' but this machine has no CUDA device; use cpu or auto"


@pytest.mark.parametrize("tree_or_text, line", [
    ({"model": {"path": "m", "device": "tpu9"}, "data": {"task": "addition"}},
     "model.device: Value error, not a device"),
    ({"model": {"path": "m"}, "data": {"task": "addition"}, "controller": {"steps": True}},
     "controller.steps: expected a whole number, not a boolean (got True)"),
    ({"model": {"path": "m"}, "data": {"task": "addition"}, "generation": {"max_tokens": 10**12}},
     "generation.max_tokens: Input should be less than or equal to 1048576 (got 1000000000000)"),
    ({"model": {"path": "m"}, "data": {"task": "addition"}, "training": {"seed": 2**40}},
     "training.seed: must be at most 2,147,483,647 in size (got 1099511627776)"),
    ("model: {path: m}\ndata: {task: addition}\nmodel: {path: other}\n",
     "{cfg}: line 3: key 'model' appears twice (first on line 1); YAML would silently keep only the last one"),
    (b"model: {path: m\xe9}\ndata: {task: addition}\n",
     "{cfg}: not UTF-8 text (byte 0xe9 at offset 15); save the file as UTF-8"),
])
def test_train_rejects_with_one_line_and_exit_2(tmp_path, capsys, tree_or_text, line):
    path = tmp_path / "cfg.yaml"
    if isinstance(tree_or_text, dict):
        path.write_text(yaml.safe_dump(tree_or_text))
    else:
        path.write_bytes(tree_or_text if isinstance(tree_or_text, bytes) else tree_or_text.encode())
    for command in ("validate", "train"):
        code, _, err = run_cli([command, str(path)], capsys)
        assert code == 2
        want = line.replace("{cfg}", str(path)).replace("Value error, ", "")
        assert err.splitlines()[1:] == [err.splitlines()[1]] and err.splitlines()[1].startswith(want), err


@pytest.mark.parametrize("content, needle", [
    (None, "data.path: no such file or folder"),
    ("", "has no rows"),
    ('{"prompt": "a"}\n{"prompt": \n', "line 2 is not JSON"),
])
def test_train_subprocess_data_problems_exit_2(tmp_path, content, needle):
    data = tmp_path / "rows.jsonl"
    if content is not None:
        data.write_text(content)
    path = write(tmp_path, {"model": {"path": "org/model"}, "data": {"path": str(data)},
                            "rewards": [{"function": "tokenmill.data.tasks:addition_reward"}]})
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "train", path], check=False, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 2  # "invalid configuration" and the one problem


def test_a_broken_row_deep_in_the_file_is_one_line_at_load(tmp_path):
    from tokenmill.data.prompts import load_rows

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(50)) + "{broken\n")
    with pytest.raises(ConfigError) as err:
        load_rows(str(data))
    assert str(err.value).startswith(f"data.path: cannot read {str(data)!r}: ")
    assert "\n" not in str(err.value)


def test_check_run_accepts_a_good_setup(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    (tmp_path / "rewards.py").write_text(REWARDS)
    cfg = load_config(RLConfig, {
        "model": {"path": str(tmp_path / "model"), "tokenizer_path": str(tmp_path / "tok"), "device": "cpu"},
        "data": {"path": rows_file(tmp_path, [{"prompt": "p", "answer": "a"}])},
        "rewards": [{"function": f"{tmp_path / 'rewards.py'}:needs_answer"},
                    {"function": f"{tmp_path / 'rewards.py'}:one", "per_sample": True}],
    })
    assert check_run(cfg) == []


@pytest.mark.parametrize("command, content, line", [
    ("sft", None, "data.path: no such file or folder"),
    ("sft", "", "data.path: '{data}' has no rows"),
    ("preference", '{"prompt": "a", "chosen": "b", "rejected": "c"}\nnot json\n', "data.path: '{data}' line 2 is not JSON"),
])
def test_sft_and_preference_check_their_data_first(tmp_path, capsys, command, content, line):
    data = tmp_path / "pairs.jsonl"
    if content is not None:
        data.write_text(content)
    path = write(tmp_path, {"model": {"path": "./no-such-model"}, "data": {"path": str(data)}})
    code, _, err = run_cli([command, path], capsys)
    assert code == 2
    assert err.splitlines()[1] == "model.path: no model folder at './no-such-model'"
    assert err.splitlines()[2].startswith(line.replace("{data}", str(data)))


LONG = "x" * 5000  # longer than any file name the OS accepts


@pytest.mark.parametrize("argv, line", [
    (["validate", f"{LONG}.yaml"], "x" * 200 + "...: cannot read the config file (File name too long)"),
    (["validate", "--model.path", f"./{LONG}", "--data.task", "addition"],
     "model.path: no model folder at './" + "x" * 198 + "...'"),
    (["validate", "--model.path", "m", "--data.path", f"{LONG}.jsonl"],
     "data.path: no such file or folder '" + "x" * 200 + "...' (a local json/jsonl/csv/parquet file or folder, or a "
     "hub dataset name such as org/name)"),
    (["validate", "--model.path", "m", "--data.task", "addition", "--rewards", f"[{{function: {LONG}.py:f}}]"],
     "rewards.0.function: cannot read '" + "x" * 200 + "...': OSError"),
    (["validate", "--model.path", "m", "--data.task", "addition", "--env", f"{{name: {LONG}.py:f}}"],
     "env.name: cannot read '" + "x" * 200 + "...': OSError"),
])
def test_names_the_os_refuses_are_one_short_line(argv, line, capsys):
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert err.splitlines()[1:] == [line]


def test_the_libraries_progress_bars_are_off_without_importing_them():
    """The CLI turns transformers', datasets' and the hub's progress bars off through their environment switches,
    so that no command pays for importing a library just to silence it."""
    probe = ("import os, sys; from tokenmill.cli import _quiet_libraries; _quiet_libraries(); "
             "print('HEAVY', [m for m in ('transformers', 'datasets') if m in sys.modules]); "
             "import datasets, transformers; "
             "print('BARS', transformers.utils.logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled())")
    env = {k: v for k, v in os.environ.items() if "PROGRESS_BARS" not in k}
    done = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout and "BARS False False" in done.stdout, done.stdout


# ------------------------------------------------------------------------------------- tied heads on vLLM


def _model_folder(tmp_path: Path, tied: bool) -> str:
    folder = tmp_path / f"model-{tied}"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": tied}))
    return str(folder)


def _vllm_cfg(tmp_path: Path, tied: bool, url: str = "http://127.0.0.1:8000", **engine) -> str:
    return write(tmp_path, {"model": {"path": _model_folder(tmp_path, tied)}, "data": {"task": "addition"},
                            "engine": {"placement": "remote", "urls": [url], "sync": "vllm", **engine}})


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_has_gpu(), reason="vLLM on this machine could run on its GPU")
@pytest.mark.parametrize("sync", ["vllm", "vllm_broadcast"])
def test_a_tied_model_pushed_into_vllm_on_the_cpu_is_refused(tmp_path, capsys, sync):
    code, out, err = run_cli(["validate", _vllm_cfg(tmp_path, tied=True, sync=sync)], capsys)
    assert code == 2 and out == ""
    assert err.splitlines()[1].startswith(f"engine.sync: {sync}: model.path has tied input and output embeddings, "
                                          "and vLLM on the CPU does not reload a tied output head in place")


def test_untied_lora_or_remote_vllm_servers_pass(tmp_path, capsys):
    assert run_cli(["validate", _vllm_cfg(tmp_path / "a", tied=False)], capsys)[0] == 0
    code, out, _ = run_cli(["validate", _vllm_cfg(tmp_path / "b", tied=True, url="http://10.1.2.3:8000")], capsys)
    assert code == 0 and "note: engine.urls: if these vLLM servers run on the CPU, model.path has tied" in out
    lora = yaml.safe_load(Path(_vllm_cfg(tmp_path / "c", tied=True)).read_text())
    lora["model"]["lora"] = {"rank": 4}  # adapters alone reach vLLM: the head is not reloaded
    assert run_cli(["validate", write(tmp_path / "c", lora, "lora.yaml")], capsys)[0] == 0


# --------------------------------------------------------------------------------------- issue 39.7


def test_lora_targets_the_model_lacks_are_refused_by_validate_loading_no_weights(tmp_path, capsys, tiny_model_path):
    """The modules are read from a meta-device build of the model's config: the weights file is not even opened
    (it is moved away here), yet a target the Llama lacks is one line naming its linear layers."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        if (Path(tiny_model_path) / name).is_file():
            (model / name).write_bytes((Path(tiny_model_path) / name).read_bytes())
    tree = {"model": {"path": str(model), "lora": {"rank": 4, "target_modules": ["c_attn", "query_key_value"]}},
            "data": {"task": "addition"}}
    code, out, err = run_cli(["validate", write(tmp_path, tree)], capsys)
    assert code == 2 and out == ""
    line = err.splitlines()[1]
    assert line.startswith("model.lora.target_modules: ['c_attn', 'query_key_value'] name no module of the model at ")
    assert "'q_proj'" in line and "'down_proj'" in line and "'lm_head'" in line
    # one target of two that exists: valid, with a note; the model's own names: valid, no note
    tree["model"]["lora"]["target_modules"] = ["q_proj", "c_attn"]
    code, out, _ = run_cli(["validate", write(tmp_path, tree)], capsys)
    assert code == 0 and "note: model.lora.target_modules: ['c_attn'] name no module of the model" in out
    tree["model"]["lora"]["target_modules"] = ["q_proj", "v_proj"]
    code, out, _ = run_cli(["validate", write(tmp_path, tree)], capsys)
    assert code == 0 and "note:" not in out

"""`tokenmill quickstart | train | sft | eval | validate | preference | env serve | composer | serve | serve-trainer | vllm`.

Config errors print one line per bad field and exit with status 2, never a traceback. A run stopped by SIGTERM
or Ctrl-C after saving its checkpoint exits with status 75 (`checkpoint.preempt`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

from tokenmill.types import ConfigError, TokenmillError

CONFIG_COMMANDS = {"train", "sft", "eval", "validate", "preference", "plan"}
TRAIN_FLAGS = ("--replay DIR: train from the rollouts recorded in DIR, with no engine (record.replay); "
               "--rollout-only: generate and score, record, never train (record.rollout_only).")
MAX_LINE = 600  # characters of one error line shown (a message quoting a huge value is cut)
CONFIG_KEYS = "{config keys}"  # in a config command's epilog: its schema's top-level keys, read when help is shown
SCHEMAS = {"sft": "SFTConfig", "preference": "PreferenceConfig"}  # the other config commands read RLConfig


class _ConfigHelp(argparse.HelpFormatter):
    """`tokenmill train --help` and the other config commands: CONFIG_KEYS in the epilog becomes the config's
    top-level keys, imported only when help is shown (the schema costs every other command a quarter second)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if CONFIG_KEYS in text:
            from tokenmill import config

            schema = getattr(config, SCHEMAS.get(self._prog.split()[-1], "RLConfig"))
            text = text.replace(CONFIG_KEYS, ", ".join(schema.model_fields))
        return super()._fill_text(text, width, indent)


def _rl_config(path: str | None, overrides: list[str]):
    from tokenmill.config import RLConfig, load_config, parse_overrides

    return load_config(RLConfig, path, parse_overrides(overrides))


def cmd_plan(args: argparse.Namespace) -> int:
    """`tokenmill plan CONFIG`: where `cluster:` puts each trainer rank, role and engine replica; starts nothing."""
    from tokenmill.config.cluster import make_plan, roles_in_use

    cfg = _rl_config(args.config, args.overrides)
    if cfg.cluster.backend != "ray":
        print("cluster: local (one process, or the ranks torchrun starts); set cluster.backend: ray to place "
              "ranks and engines on a Ray cluster")
        return 0
    print("\n".join(make_plan(cfg.cluster, roles_in_use(cfg)).lines()))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from tokenmill.config.preflight import check_run

    cfg = _rl_config(args.config, args.overrides)
    if cfg.cluster.backend == "ray":  # a layout that cannot be placed fails here, not after cluster.start_timeout_s
        from tokenmill.config.cluster import make_plan, roles_in_use

        make_plan(cfg.cluster, roles_in_use(cfg))
    for note in check_run(cfg):
        print(f"note: {note}")
    seqs = cfg.sequences_per_step
    print(f"{args.config or 'config'}: valid. {cfg.controller.steps} steps of {cfg.controller.prompts_per_step} prompts x "
          f"{cfg.generation.group_size} samples = {seqs} sequences each.")
    return 0


def record_flags(overrides: list[str]) -> list[str]:
    """`--replay DIR` and `--rollout-only` of `tokenmill train`, as the `record:` overrides they stand for."""
    out, i = [], 0
    while i < len(overrides):
        arg = overrides[i]
        if arg == "--rollout-only":
            out += ["--record.rollout_only", "true"]
        elif arg == "--replay" or arg.startswith("--replay="):
            if arg == "--replay" and i + 1 >= len(overrides):
                raise ConfigError("--replay: give the folder of a rollout dump")
            out += ["--record.replay", arg.split("=", 1)[1] if "=" in arg else overrides[i + 1]]
            i += arg == "--replay"
        else:
            out.append(arg)
        i += 1
    return out


def cmd_train(args: argparse.Namespace) -> int:
    from tokenmill.config.preflight import check_run

    cfg = _rl_config(args.config, record_flags(args.overrides))
    check_run(cfg)  # files, columns, device: one line each, before the ML stack is even imported
    if cfg.cluster.backend == "ray":  # the same loop in this process, its trainer ranks on Ray
        from tokenmill.controller.ray.run import train_on_ray

        _print_eval(train_on_ray(cfg))
        return 0
    from tokenmill.controller import build_run, run_rl

    run = build_run(cfg)
    try:
        result = run_rl(run)  # proxy mode too: its feed serves the policy and takes the agent's episodes
    finally:
        run.close()
    _print_eval(result)
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from tokenmill.config import SFTConfig, load_config, parse_overrides

    cfg = load_config(SFTConfig, args.config, parse_overrides(args.overrides))  # before the ML stack loads
    from tokenmill.api import sft
    from tokenmill.training.dist import is_main

    result = sft(cfg)
    if is_main():  # under torchrun: one summary, not one per rank
        losses = result["losses"]
        print(f"sft: loss {losses[0]:.3f} -> {losses[-1]:.3f}; model written to {result['output_dir']}")
    return 0


def cmd_preference(args: argparse.Namespace) -> int:
    from tokenmill.config import PreferenceConfig, load_config, parse_overrides

    cfg = load_config(PreferenceConfig, args.config, parse_overrides(args.overrides))  # before the ML stack loads
    from tokenmill.api import preference
    from tokenmill.training.dist import is_main

    result = preference(cfg)
    if is_main():  # under torchrun: one summary, not one per rank
        losses = result.pop("losses")
        print(json.dumps({"objective": result.pop("objective"), "loss_first": losses[0], "loss_last": losses[-1],
                          **result}))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """The held-out evaluation of `model.path` a run of the config does, with the same numbers: an `env:`
    config's episodes through the agent loop, else samples scored by its rewards; greedy, plus pass@k, maj@k
    and avg@n with `controller.eval_samples`. A NaN result exits non-zero."""
    from tokenmill.config.preflight import check_run
    from tokenmill.controller.evaluate import evaluate_config
    from tokenmill.data.build import build_datasets
    from tokenmill.engines.local.hf import HFEngine
    from tokenmill.rewards.build import build_rewards
    from tokenmill.training.model import autocast_dtype, load_policy, resolve_device

    cfg = _rl_config(args.config, args.overrides)
    check_run(cfg)
    train_rows, eval_rows, task_reward = build_datasets(cfg)
    rewards = build_rewards(cfg, task_reward=task_reward)
    device = resolve_device(cfg.model.device)
    model, tok = load_policy(cfg.model, device)
    engine = HFEngine(model, tok, seed=cfg.training.seed, autocast_dtype=autocast_dtype(cfg.model, device),
                      fast_decode=cfg.engine.fast_decode, cuda_graphs=cfg.engine.cuda_graphs,
                      compile_step=cfg.engine.compile_step, max_batch_tokens=cfg.engine.max_batch_tokens,
                      **cfg.engine.paged_options())
    try:
        result = evaluate_config(cfg, engine, tok, rewards, eval_rows if eval_rows is not None else train_rows)
    finally:
        rewards.close()
    print(json.dumps(result))
    return 0


def _print_eval(result: dict[str, Any]) -> None:
    before, after = result.get("eval_before"), result.get("eval_after")
    if before and after:
        gain = after["eval/accuracy"] - before["eval/accuracy"]
        print(f"held-out greedy accuracy: {before['eval/accuracy']:.3f} -> {after['eval/accuracy']:.3f} "
              f"({gain * 100:+.1f} points, {after['eval/rows']} problems)")


def cmd_estimate(args: argparse.Namespace) -> int:
    """Memory per model and per device for a config (RL, SFT, preference or reward model), without loading it."""

    from tokenmill.config.load import read_yaml_tree
    from tokenmill.estimate import estimate_for_config
    from tokenmill.estimate.report import render

    tree = read_yaml_tree(args.config)
    result = estimate_for_config(tree, device_memory_gib=args.device_memory_gib, num_devices=args.num_devices)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render(result)
    return 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    """Tiny model -> supervised warm start -> GRPO on addition, with accuracy before and after."""
    import torch

    from tokenmill.recipes import quickstart

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    result = quickstart(args.output_dir, steps=args.steps, sft_steps=args.sft_steps, learning_rate=args.lr,
                        seed=args.seed, console=args.console)
    _print_eval(result)
    print(f"done in {result['seconds']:.0f}s; trained model in {Path(args.output_dir) / 'grpo' / 'final'}")
    return 0


def cmd_env_serve(args: argparse.Namespace) -> int:
    import logging

    from tokenmill.envs.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        kwargs = json.loads(args.kwargs)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--kwargs: not JSON ({exc})") from None
    if not isinstance(kwargs, dict):
        raise ConfigError("--kwargs: expected a JSON object of constructor arguments")
    token = args.token or os.environ.get("TOKENMILL_ENV_TOKEN") or None
    try:
        serve(args.env, host=args.host, port=args.port, token=token, allow_remote=args.allow_remote, kwargs=kwargs,
              max_episodes=args.max_episodes, step_timeout_s=args.step_timeout_s,
              max_body_bytes=int(args.max_body_mb * 2**20), limits=_limits(args))
    except ValueError as exc:  # a bad spec or an unsafe exposure: one line, no traceback
        raise ConfigError(f"env serve: {exc}") from None
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """`tokenmill serve MODEL_DIR`: the OpenAI-compatible engine server (tokenmill.engines.server.app)."""
    import logging

    from tokenmill.engines.server.app import serve
    from tokenmill.sandbox.lifetime import watch_parent

    watch_parent()  # started by a trainer (`engine.placement: process`): go when it goes
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    token = args.token if args.token is not None else os.environ.get("TOKENMILL_SERVE_TOKEN") or None
    try:
        serve(args.model_dir, host=args.host, port=args.port, token=token, allow_remote=args.allow_remote,
              served_model_name=args.served_model_name, dtype=args.dtype, max_batch=args.max_batch,
              max_batch_tokens=args.max_batch_tokens, seed=args.seed, device=args.device,
              kv_cache=args.kv_cache, kv_block_size=args.kv_block_size,
              max_body_bytes=int(args.max_body_mb * 2**20), limits=_limits(args),
              allow_remote_images=args.allow_remote_images, max_image_pixels=args.max_image_pixels,
              return_routed_experts=args.enable_return_routed_experts)
    except ValueError as exc:  # an unsafe exposure, a bad folder or flag: one line, no traceback
        print(f"tokenmill serve: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_serve_trainer(args: argparse.Namespace) -> int:
    """`tokenmill serve-trainer MODEL`: the training service (tokenmill.client) over HTTP."""
    from tokenmill.client.server import serve

    token = args.token if args.token is not None else os.environ.get("TOKENMILL_TRAINER_TOKEN") or None
    try:
        serve(args.model_dir, host=args.host, port=args.port, token=token, allow_remote=args.allow_remote,
              root=args.root, device=args.device, limits=_limits(args))
    except ValueError as exc:  # an unsafe exposure or a bad folder: one line, no traceback
        print(f"tokenmill serve-trainer: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_composer(args: argparse.Namespace) -> int:
    from tokenmill.composer.app import ExposureError, serve

    if args.max_runs < 1:
        print(f"tokenmill composer: --max-runs must be at least 1 (got {args.max_runs})", file=sys.stderr)
        return 2
    try:
        serve(args.host, args.port, token=args.token or os.environ.get("TOKENMILL_COMPOSER_TOKEN") or None,
              allow_remote=args.allow_remote, runs_dir=args.runs_dir, max_runs=args.max_runs, limits=_limits(args))
    except ExposureError as exc:  # one line, exit 2, nothing bound
        print(f"tokenmill composer: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_vllm(args: argparse.Namespace) -> int:
    from tokenmill.engines.vllm.launch import serve_command

    return serve_command(args)


def _server_args(parser: argparse.ArgumentParser, *, port: int, token_env: str) -> None:
    """The bind flags every token-guarded server takes: loopback unless allowed, a bearer token."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    parser.add_argument("--port", type=int, default=port, help="0 picks a free port (printed when ready)")
    parser.add_argument("--token", default=None, help=f"bearer token (default: ${token_env})")
    parser.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --host (needs a token)")
    _limit_args(parser)


def _kv_cache_args(parser: argparse.ArgumentParser) -> None:
    """`tokenmill serve`'s key/value cache flags (engine.kv_cache, engine.kv_block_size), and the routing it records
    with `--enable-return-routed-experts` (router replay r3; recording turns the paged cache off)."""
    parser.add_argument("--kv-cache", default="static", choices=["static", "paged"],
                        help="decode key/value cache: static (one padded batch) or paged (blocks; docs/performance.md)")
    parser.add_argument("--kv-block-size", type=_positive(int), default=16, help="tokens per block of the paged cache")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="a mixture-of-experts model: record each token's experts, returned to requests with "
                             "return_routed_experts (router replay r3; vLLM's flag name)")


def _vllm_start_args(parser: argparse.ArgumentParser) -> None:
    """`tokenmill vllm`'s start-up flags: how long to wait, and the routing answer (router replay r3)."""
    parser.add_argument("--timeout-s", type=float, default=300.0, help="longest wait for the server to be ready")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="a mixture-of-experts model: answer each completion's routing (router replay r3; vLLM's "
                             "V2 model runner, which needs Triton: not on the CPU build)")


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _limit_args(parser: argparse.ArgumentParser) -> None:
    """The connection limits every server takes (tokenmill.serving_limits)."""
    parser.add_argument("--read-timeout-s", type=_positive(float), default=30.0,
                        help="seconds a client may take to send a request's head (and to pause in its body); "
                             "answers are not timed")
    parser.add_argument("--max-connections", type=_positive(int), default=None,
                        help="open connections at most; at the cap the slowest waiting one is closed "
                             "(default: half the open-file limit, at most 1000)")


def _limits(args: argparse.Namespace) -> Any:
    from tokenmill.serving_limits import ConnectionLimits

    return ConnectionLimits(read_timeout_s=args.read_timeout_s, max_connections=args.max_connections)


def _request_args(parser: argparse.ArgumentParser) -> None:
    """What a `tokenmill serve` request may carry: its body size, and images (a vision-language model folder)."""
    parser.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body in MiB (413 beyond)")
    parser.add_argument("--allow-remote-images", action="store_true",
                        help="a vision-language model: fetch http(s) image_url parts (refused otherwise)")
    parser.add_argument("--max-image-pixels", type=int, default=4096 * 4096,
                        help="a vision-language model: largest image (width x height) accepted (400 beyond)")


def _with_serve_trainer(parser: argparse.ArgumentParser, sub) -> argparse.ArgumentParser:
    """`parser` with the `serve-trainer` command added to its subcommands `sub`."""
    st = sub.add_parser("serve-trainer", help="the training API (LoRA clients of one base model) over HTTP")
    st.add_argument("model_dir", help="a Hugging Face model folder: the base model the clients' adapters train")
    _server_args(st, port=8100, token_env="TOKENMILL_TRAINER_TOKEN")
    st.add_argument("--root", default="runs/trainer", help="folder of saved states and sampler weights")
    st.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1)")
    st.set_defaults(fn=cmd_serve_trainer)
    return parser


@functools.cache  # built once per process: argparse's setup costs more than validating a config
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quickstart", help="tiny model -> warm start -> GRPO on addition (CPU, minutes)")
    q.add_argument("--output-dir", default="runs/quickstart")
    q.add_argument("--steps", type=int, default=200)
    q.add_argument("--sft-steps", type=int, default=700)
    q.add_argument("--lr", type=float, default=5e-5)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--console", default="plain", choices=["rich", "plain", "none"])
    q.set_defaults(fn=cmd_quickstart)
    for name, fn, text in [
        ("train", cmd_train, "run RL from a YAML config"),
        ("sft", cmd_sft, "supervised fine-tuning from a YAML config"),
        ("eval", cmd_eval, "held-out evaluation of a model (greedy; pass@k, maj@k)"),
        ("validate", cmd_validate, "check a config without loading anything"),
        ("plan", cmd_plan, "print where a config's trainer ranks and engines run (starts nothing)"),
        ("preference", cmd_preference, "DPO / IPO / SimPO or a reward model on preference pairs"),
    ]:
        epilog = (f"config keys: {CONFIG_KEYS}. Every field, its default and allowed values: docs/reference/config.md "
                  "(or `tokenmill composer`). " + (TRAIN_FLAGS if name == "train" else ""))
        p = sub.add_parser(name, help=text, epilog=epilog, formatter_class=_ConfigHelp,
                           description=f"{text}. Override any field with --section.field VALUE.")
        p.add_argument("config", nargs="?", default=None, help="YAML config file")
        p.set_defaults(fn=fn, overrides=[])
    est = sub.add_parser("estimate", help="memory per model and per device for a config (no model is loaded)")
    est.add_argument("config", help="YAML config (train, sft or preference; optional `mode:` and `estimate:` keys)")
    est.add_argument("--device-memory-gib", type=float, default=None,
                     help="memory of one device in GiB: checks the fit and sizes the micro-batch")
    est.add_argument("--num-devices", type=int, default=1, help="data-parallel devices (sharded with FSDP when > 1)")
    est.add_argument("--json", action="store_true", help="print the whole estimate as JSON")
    est.set_defaults(fn=cmd_estimate)
    env = sub.add_parser("env", help="environment tools").add_subparsers(dest="env_command", required=True)
    srv = env.add_parser("serve", help="serve an environment over HTTP (JSON) for `env.url` in a config")
    srv.add_argument("env", help="'module:Class' of your environment, or a built-in name (guess_number, coding)")
    _server_args(srv, port=8765, token_env="TOKENMILL_ENV_TOKEN")
    srv.add_argument("--kwargs", default="{}", help="JSON object of constructor arguments")
    srv.add_argument("--max-episodes", type=int, default=1024, help="live episodes at once")
    srv.add_argument("--step-timeout-s", type=float, default=60.0, help="seconds one reset / step / close may take")
    srv.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body in MiB (413 beyond)")
    srv.set_defaults(fn=cmd_env_serve)
    srv = sub.add_parser("serve", help="OpenAI-compatible engine server with continuous batching")
    srv.add_argument("model_dir", help="a Hugging Face model folder (config.json, weights, tokenizer)")
    _server_args(srv, port=8000, token_env="TOKENMILL_SERVE_TOKEN")
    srv.add_argument("--served-model-name", default=None, help="the model id in answers (default: folder name)")
    srv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    srv.add_argument("--max-batch", type=int, default=256, help="running sequences at most")
    srv.add_argument("--max-batch-tokens", type=int, default=0,
                     help="key/value tokens the running sequences may claim, each its prompt + max_tokens (0: no limit)")
    _kv_cache_args(srv)
    srv.add_argument("--seed", type=int, default=0, help="seed of the sampling of requests without their own")
    srv.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1)")
    _request_args(srv)
    srv.set_defaults(fn=cmd_serve)
    vl = sub.add_parser("vllm", help="start a vLLM server for a model folder (vLLM in its own cached venv)")
    vl.add_argument("model_dir", nargs="?", default=None, help="a Hugging Face model folder")
    vl.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    vl.add_argument("--port", type=int, default=8000)
    vl.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --host (dev-mode routes!)")
    vl.add_argument("--venv", default=None, help="vLLM's venv (default: ~/.cache/tokenmill/vllm-<version>)")
    vl.add_argument("--install-only", action="store_true", help="build the venv, print its python, exit")
    vl.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion (default: the model's)")
    vl.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache on CPU in GiB")
    vl.add_argument("--no-prefix-cache", action="store_true", help="turn vLLM's prefix caching off")
    vl.add_argument("--lora-rank", type=int, default=0, help="> 0: take LoRA adapters up to this rank at run time "
                    "(rounded up to a rank vLLM takes: 1, 8, 16, 32, ...)")
    _vllm_start_args(vl)
    vl.set_defaults(fn=cmd_vllm)
    comp = sub.add_parser("composer", help="web UI: compose a config, preview rewards, launch and watch runs")
    comp.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    comp.add_argument("--port", type=int, default=8600, help="port (0 picks a free one)")
    comp.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --host")
    comp.add_argument("--token", default=None, help="access token (default: $TOKENMILL_COMPOSER_TOKEN or random)")
    comp.add_argument("--runs-dir", default="runs/composer", help="folder of the runs launched from the page")
    comp.add_argument("--max-runs", type=int, default=1,
                      help="runs the page may have running at once; a launch beyond it is refused (409)")
    _limit_args(comp)
    comp.set_defaults(fn=cmd_composer)
    return _with_serve_trainer(parser, sub)


def _quiet_libraries() -> None:
    """No per-file progress bars from transformers / datasets / the hub on our console (our own lines say what
    runs). Through their environment switches, read when they are imported: importing datasets just to call
    its switch cost every command about a second at start. Where main() runs in a process that imported them
    already, their own functions."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers follows the hub's switch
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()


def _clipped(message: str, max_lines: int = 50) -> str:
    lines = [line if len(line) <= MAX_LINE else line[:MAX_LINE] + "..." for line in message.splitlines()]
    more = len(lines) - max_lines
    return "\n".join(lines[:max_lines] + ([f"... and {more} more"] if more > 0 else []))


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from_command_line = argv is None  # not a call from Python (a test's main([...]))
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: list[str] = []
    if argv and argv[0] in CONFIG_COMMANDS and not {"-h", "--help"} & set(argv):
        # `tokenmill CMD [CONFIG.yaml] [--section.field VALUE ...]`: overrides go to the schema, not argparse
        head = 2 if len(argv) > 1 and not argv[1].startswith("--") else 1
        argv, overrides = argv[:head], argv[head:]
    args = build_parser().parse_args(argv)
    args.overrides = overrides
    _quiet_libraries()
    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"tokenmill: invalid configuration\n{_clipped(str(exc))}", file=sys.stderr)
        return 2
    except TokenmillError as exc:  # a run that cannot go on (a dead engine server, a producer timeout): one line
        print(f"tokenmill: {exc}", file=sys.stderr)
        return _exit(getattr(exc, "exit_code", 1), exc, from_command_line)  # 2: fix first (e.g. CheckpointError)
    except KeyboardInterrupt as exc:
        print("tokenmill: interrupted", file=sys.stderr)
        return _exit(130, exc, from_command_line)


def _exit(code: int, exc: BaseException, from_command_line: bool) -> int:
    """`code`, or after a stop by a signal (`checkpoint.preempt`: saved, or a second Ctrl-C), with the run closed:
    exit now, skipping the interpreter's teardown (seconds of garbage collection of the model's objects) within
    the scheduler's grace period. Only from the command line (a Python caller of `main` gets the code)."""
    if from_command_line and getattr(exc, "exit_at_once", False):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())

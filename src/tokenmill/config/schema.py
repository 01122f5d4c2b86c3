"""The typed configuration tree: the single source of truth for YAML, CLI overrides and docs.

Every field carries a description (it becomes `--help` text). Unknown keys are rejected
(`extra="forbid"`), and cross-field rules are checked here, before any model is loaded.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from tokenmill.config.algorithm import GROUP_BASELINES, AlgorithmConfig, CriticConfig
from tokenmill.config.cluster import ClusterConfig
from tokenmill.config.distill import DistillConfig, check_distill
from tokenmill.config.health import HealthConfig
from tokenmill.config.moe import check_router_replay
from tokenmill.config.openenv import OpenEnvConfig
from tokenmill.config.record import RecordConfig
from tokenmill.config.rewards import RewardConfig
from tokenmill.config.section import DEVICE, MAX_GROUP, MAX_SEQUENCES, MAX_TOKENS, LoRAConfig, Section

UnitFloat = Annotated[float, Field(ge=0.0, lt=1.0)]
TASK_EVAL_ROWS = 1000  # held-out rows a built-in task generates unless data.num_eval says otherwise




class ModelConfig(Section):
    path: str = Field(..., min_length=1, description="Hugging Face model folder (or hub id) of the policy.")
    tokenizer_path: str | None = Field(None, description="Tokenizer folder; defaults to the model path.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Training precision: auto = bf16 on GPU, fp32 on CPU."
    )
    device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N' (also 'mps', 'xpu').")
    attn_implementation: str | None = Field(None, description="Passed to from_pretrained (sdpa, eager, ...).")
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="Low-rank adapters (peft); off when rank is 0.")
    freeze_vision: bool = Field(
        True, description="A vision-language model's vision tower (encoder and merger) stays frozen; false trains "
        "it too (with LoRA: only the language model is adapted either way). No effect on a text model."
    )

    @field_validator("device")
    @classmethod
    def _device_form(cls, value: str) -> str:
        if not DEVICE.match(value):
            raise ValueError("not a device tokenmill can use: auto, cpu, cuda, cuda:N, mps or xpu")
        return value


class DataConfig(Section):
    task: str | None = Field(
        None, description="Built-in task, one of `tokenmill.data.registry.task_names()`: a row task such as "
        "'addition' brings its rows and verifier; an environment's task such as 'guess_number' is scored by its "
        "episodes; 'reasoning_gym:<name>' (or 'reasoning_gym:mix') is a reasoning-gym generator scored by its own "
        "score_answer (needs tokenmill[tasks])."
    )
    path: str | None = Field(
        None, description="Dataset: a local json/jsonl/parquet/csv file or folder, or a `datasets` hub name."
    )
    split: str = Field("train", description="Split to read when `path` is a dataset name or folder.")
    prompt_column: str = Field("prompt", description="Column holding the prompt (a string or chat messages).")
    num_train: int = Field(20000, ge=1, description="Rows generated for a built-in task's training set.")
    num_eval: int | None = Field(
        None, ge=0, description="Held-out rows for greedy evaluation (0 = none). A built-in task generates them "
        f"(default {TASK_EVAL_ROWS}); a dataset (`path`) has them split off, seeded by training.seed (default 0)."
    )
    eval_path: str | None = Field(
        None, description="Held-out rows in a dataset of their own (the forms `path` takes), evaluated with the "
        "run's rewards or environment; for a `path` dataset, instead of `num_eval`."
    )
    task_kwargs: dict = Field(default_factory=dict, description="Arguments for the built-in task generator.")
    task_reward_weight: float = Field(
        1.0, ge=0.0, description="Weight of the built-in task's verifier in the total reward; 0 keeps it as a "
        "measurement only (e.g. when training against a reward model of the same task)."
    )
    shuffle: bool = Field(True, description="Shuffle rows each epoch (seeded; resumes exactly).")
    image_column: str = Field(
        "images", description="Column holding each row's images for a vision-language model (TRL's `images`: a "
        "list of PIL images, paths or data URLs); `image_url` parts inside the prompt's messages work too."
    )
    allow_remote_images: bool = Field(
        False, description="Fetch http(s) image URLs; off: a row with a remote image fails with the reason."
    )
    max_image_pixels: int = Field(
        4096 * 4096, ge=1, description="An image larger than this (width x height) fails its own row."
    )

    @property
    def held_out_rows(self) -> int:
        """Rows held out for evaluation: `num_eval`, or its default for the source (a task's, else none)."""
        return self.num_eval if self.num_eval is not None else TASK_EVAL_ROWS if self.task is not None else 0

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if self.task is not None and self.path is not None:  # neither: RLConfig allows it for env.verifiers
            raise ValueError("set exactly one of data.task or data.path")
        if self.eval_path is not None and self.path is None:
            raise ValueError("data.eval_path is for a dataset given by data.path (a built-in task makes its own "
                             "held-out rows)")
        if self.eval_path is not None and self.num_eval:
            raise ValueError("set one of data.eval_path or data.num_eval (held-out rows come from a file or are "
                             "split off data.path, not both)")
        from tokenmill.data.registry import task_problem  # the one task registry (imported late: no cycle)

        problem = task_problem(self.task, self.task_kwargs) if self.task is not None else None
        if problem:
            raise ValueError(problem)
        return self


class GenerationConfig(Section):
    group_size: int = Field(8, ge=1, le=MAX_GROUP, description="Completions sampled per prompt (G).")
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS, description="Maximum new tokens per completion.")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="Sampling temperature (> 0).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, le=MAX_TOKENS, description="Keep only the k most likely tokens (0 = off).")
    stop: list[str] = Field(default_factory=list, description="Stop strings; text is cut before them.")


class EnvConfig(Section):
    """Multi-turn episodes against an environment instead of single completions scored by rewards."""

    name: str | None = Field(
        None, description="Environment: a built-in name (guess_number, calculator, coding, gym), or your own as "
        "'module:Class' or 'path/to/file.py:Class' (reset(task) -> messages, step(message) -> StepResult, close())."
    )
    url: str | None = Field(None, description="A remote environment served by `tokenmill env serve` (http://host:port).")
    verifiers: str | None = Field(
        None, description="A verifiers (v1) environment: an installed taskset id, or a .py file exporting a "
        "`vf.Taskset` through `__all__`; it plays its own episodes (its harness, tools and rewards) against the "
        "policy through the recording proxy, and its tasks are the rows. `kwargs` is its verifiers `[env]` block "
        "(`taskset` fields, `agent`, `id`). Needs `pip install tokenmill[verifiers]`."
    )
    token: str | None = Field(None, description="Bearer token for `url` (default: $TOKENMILL_ENV_TOKEN).")
    openenv: OpenEnvConfig | None = Field(None, description="An OpenEnv environment (a server at a URL, or one "
                                          "this run serves): text to actions, observations to messages.")
    kwargs: dict = Field(default_factory=dict, description="Keyword arguments for the environment's constructor.")
    max_turns: int = Field(8, ge=1, description="Policy turns per episode.")
    max_episode_tokens: int = Field(
        1024, ge=8, description="Token budget of an episode (prompt, turns and observations); it ends when spent."
    )
    step_timeout_s: float = Field(30.0, gt=0, description="Seconds a reset / step / close may take; then the episode fails.")
    max_concurrent: int = Field(256, ge=1, description="Live episodes at once (the engine's batch is at most this).")
    stepwise: bool = Field(False, description="One sample per model call (the conversation as the policy saw it, "
        "which the env may rewrite: StepResult.history), each with the episode's return and its per-episode "
        "group advantage, instead of one sequence per episode; max_episode_tokens bounds each call's context.")
    prefix_cache_mb: float = Field(
        512.0, ge=0, description="Engine memory for the key/value states of earlier turns, so that a turn reads only "
        "its new tokens (0 = off: every turn re-reads its whole history)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> EnvConfig:
        if sum(source is not None for source in (self.name, self.url, self.openenv, self.verifiers)) != 1:
            raise ValueError("set exactly one of env.name, env.url, env.openenv or env.verifiers")
        return self


class OptimConfig(Section):
    """The optimiser, declared once for every mode: AdamW with a warm-up and a decay schedule, and the seed.

    RL reads it as the `training:` section (`TrainingConfig`); SFT and preference configs carry its fields at
    the top level (`SFTConfig`, `PreferenceConfig`). A subclass changes only defaults, through `DEFAULTS`
    (a field's bounds and help stay the ones declared here)."""

    DEFAULTS: ClassVar[dict[str, Any]] = {}

    learning_rate: float = Field(1e-5, gt=0.0, le=1.0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[UnitFloat, UnitFloat] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up optimiser steps.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Decay after warm-up, over all optimiser steps of the run."
    )
    max_grad_norm: float = Field(1.0, gt=0.0, description="Clip the global gradient norm to this.")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        defaults = cls.__dict__.get("DEFAULTS")
        if defaults:
            for name, value in defaults.items():
                cls.__pydantic_fields__[name] = FieldInfo.merge_field_infos(cls.__pydantic_fields__[name],
                                                                            default=value)
            cls.model_rebuild(force=True)

    def optimiser(self) -> dict[str, Any]:
        """The optimiser fields alone, as keywords (`run_sft(..., **cfg.optimiser())`)."""
        return {name: getattr(self, name) for name in OptimConfig.model_fields}


class TrainingConfig(OptimConfig):
    micro_batch_tokens: int = Field(
        8192, ge=16, description="Token budget (padded) of one micro-batch; gradients accumulate across them."
    )
    chunked_logprobs: bool = Field(
        True, description="Token logprobs (and entropies) through the LM head in chunks of logprob_chunk_mib of "
        "fp32 logits, never the full [tokens, vocabulary] logits (same numbers; see docs/performance.md)."
    )
    logprob_chunk_mib: int = Field(64, ge=1, description="Logits held at once with chunked_logprobs, in MiB.")
    fast_forward: bool = Field(
        True, description="Llama-family decoders (Llama, Qwen2/3, Mistral) run their training and logprob "
        "forward through the engine's own step code, not transformers' forward (same numbers, less per-call "
        "work; docs/performance.md). false: transformers' forward."
    )
    share_prompts: bool = Field(
        True, description="Run each group's shared prompt through the model once per update: its completions "
        "are packed after one copy of it with a block attention mask (same gradients, fewer tokens)."
    )
    deterministic: bool = Field(
        False, description="Bit-exact runs: deterministic torch algorithms and a fixed thread count, so a run "
        "killed and resumed ends with exactly the weights of an uninterrupted one, and (zero_mismatch) engine "
        "logprobs equal to the trainer's bit for bit (slower; see docs/reliability.md)."
    )
    backend: Literal["local", "fsdp2"] = Field(
        "local", description="local: one process trains the whole model. fsdp2: every torchrun rank trains a "
        "shard of it (FSDP2) on its share of each step's prompt groups and samples its share of the prompts; "
        "launch with torchrun (see docs/scale-out.md)."
    )
    router_replay: Literal["off", "r2", "r3"] = Field(
        "off", description="Mixture-of-experts policies: route each token in the trainer to the experts it went "
        "to before instead of choosing again. r3: the experts the engine chose while sampling, replayed in every "
        "trainer pass (single-turn rollouts; engine.placement colocated, thread, process, or remote servers started "
        "with --enable-return-routed-experts: tokenmill serve, vLLM); r2: "
        "the trainer's own choice in a no-grad pass before the update, replayed in the update's passes "
        "(docs/health.md). off for a dense model."
    )
    # --- keeping the GPU fed (docs/performance.md: "The trainer near peak", "One GPU, every GiB used")
    activation_checkpointing: bool = Field(
        False, description="Keep only each decoder layer's input for the backward and compute the rest again "
        "(transformers' gradient checkpointing): less activation memory for about a third more compute. Same "
        "gradients. The fast forward steps aside while it is on."
    )
    kernels: Literal["none", "liger"] = Field(
        "none", description="liger: the policy's RMS norms, SwiGLU MLPs and rotary embeddings run liger-kernel's "
        "fused Triton ops (a CUDA device; pip install tokenmill[kernels]). none: PyTorch's own."
    )
    optimizer_offload: bool = Field(
        False, description="Keep AdamW's moments (and the step's fp32 parameter copy) in CPU memory: each "
        "optimiser step copies the gradients there, steps on the CPU and copies the weights back. Same "
        "weights; frees 8 bytes per trained parameter on the GPU for a slower step."
    )
    memory_check: bool = Field(
        True, description="Before the policy loads on a GPU, compare tokenmill estimate's peak with the device's "
        "memory and refuse a run that will not fit, naming the settings that would (false: load anyway). "
        "TOKENMILL_DEVICE_MEMORY_GIB sets the memory to check against (any device)."
    )
    zero_mismatch: bool = Field(
        True, description="With deterministic: true, an in-process engine (colocated or thread) reports for each "
        "sample the logprobs of a scoring pass through the trainer's own function, and the trainer computes "
        "each sample as a row of its own, so mismatch/max_abs is exactly 0 and importance weights exactly 1 "
        "(slower on small models; docs/reliability.md, \"Zero mismatch\"). false: a deterministic run keeps the "
        "batched forwards (resume still bit-exact). No effect without deterministic."
    )

    @model_validator(mode="after")
    def _offload_local(self) -> TrainingConfig:
        if self.optimizer_offload and self.backend != "local":
            raise ValueError("training.optimizer_offload: the local backend only (training.backend: local); an "
                             "FSDP2 rank holds a shard of the optimiser state already")
        return self


class ControllerConfig(Section):
    steps: int = Field(100, ge=1, description="RL steps (one rollout batch each).")
    prompts_per_step: int = Field(
        8, ge=1, le=MAX_SEQUENCES, description="Prompts per step; sequences = prompts x group_size."
    )
    eval_every: int = Field(0, ge=0, description="Greedy held-out evaluation every N steps (0 = start/end only).")
    eval_max_rows: int = Field(1000, ge=1, description="Held-out rows used per evaluation.")
    eval_samples: int = Field(
        0, ge=0, le=MAX_GROUP, description="Sampled held-out evaluation beside the greedy one: n samples per "
        "held-out row at eval_temperature, reported as eval/pass@k, eval/maj@k (each k of eval_k) and "
        "eval/avg@n (0 = greedy only; see docs/evaluation.md)."
    )
    eval_k: list[int] = Field(
        default_factory=list, description="The k of eval/pass@k and eval/maj@k, each 1..eval_samples "
        "(empty: 1 and eval_samples)."
    )
    eval_temperature: float | None = Field(
        None, gt=0.0, le=10.0, description="Sampling temperature of the sampled evaluation (unset: "
        "generation.temperature)."
    )
    eval_answer: str | None = Field(
        None, description="maj@k's answer extraction: strip, boxed (the last \\boxed{...}), last_number, or "
        "an import string of fn(text) -> str | None (unset: the task's own, else strip)."
    )
    max_steps_per_run: int = Field(
        0, ge=0, description="Stop (with a checkpoint) after this many steps in one invocation; resume later "
        "with checkpoint.resume (0 = run to the end). For time-sliced jobs."
    )
    max_staleness: int = Field(
        0, ge=0, description="Asynchronous training: generation may run this many policy versions ahead of "
        "training (0 = synchronous, 1 = one-step off-policy, ...). Needs an engine.placement other than "
        "colocated to overlap. The rollout producer waits rather than exceed it; samples older than it "
        "(a server that lost an update) are dropped and counted."
    )
    partial_rollouts: bool = Field(
        False, description="Async: at a weight update, interrupt in-flight generations and continue them with "
        "the new weights (each token records its policy version). engine.placement thread only."
    )
    partial_chunk_tokens: int = Field(
        4, ge=1, description="Partial rollouts: tokens generated between checks for new weights."
    )
    rollout_timeout_s: float = Field(
        600.0, gt=0, description="Async: seconds the trainer waits for the next rollout batch before it fails "
        "naming the producer."
    )

    @model_validator(mode="after")
    def _eval_k(self) -> ControllerConfig:
        if self.eval_k and not self.eval_samples:
            raise ValueError("controller.eval_k: needs controller.eval_samples (the n samples per row pass@k "
                             "and maj@k are estimated from)")
        bad = [k for k in self.eval_k if not 1 <= k <= self.eval_samples]
        if bad:
            raise ValueError(f"controller.eval_k: {bad} outside 1..controller.eval_samples "
                             f"({self.eval_samples}): pass@k needs at least k samples per row")
        return self

    @property
    def eval_ks(self) -> list[int]:
        """The k the sampled evaluation reports: `eval_k`, or 1 and `eval_samples` (none without samples)."""
        if not self.eval_samples:
            return []
        return sorted(set(self.eval_k or [1, self.eval_samples]))


class EngineConfig(Section):
    """Where generation runs and how new weights reach it. The loop is the same for every placement."""

    placement: Literal["colocated", "thread", "worker", "process", "remote"] = Field(
        "colocated", description="colocated: the engine samples from the trainer's own module (no copy, no "
        "overlap); thread: a second in-process engine with a copy of the weights, driven by a rollout thread; "
        "worker: that engine in a spawned worker process, weights through shared memory (CPU; the two sides "
        "run at once); "
        "process: `tokenmill serve` subprocesses on loopback ports; remote: OpenAI-compatible servers at "
        "engine.urls (ours, vLLM, SGLang)."
    )
    urls: list[str] = Field(default_factory=list, description="Server base URLs (engine.placement remote).")
    num_servers: int = Field(1, ge=1, description="Servers spawned by engine.placement process.")
    sync: Literal["inprocess", "files", "broadcast", "vllm", "vllm_broadcast"] | None = Field(
        None, description="How weights reach the engine: inprocess (colocated, thread; worker: shared memory), files (safetensors "
        "folder + HTTP notify), broadcast (torch.distributed) or vllm (vLLM servers at engine.urls: safetensors "
        "folder + reload through vLLM's dev-mode routes), vllm_broadcast (vLLM servers: gloo broadcast into "
        "tokenmill's worker extension); default: inprocess in-process, files otherwise."
    )
    token: str | None = Field(None, description="Bearer token for the servers (default: $TOKENMILL_SERVE_TOKEN).")
    timeout_s: float = Field(120.0, gt=0, description="Seconds one engine request or weight update may take.")
    fast_decode: bool = Field(True, description="In-process engines decode through their own one-token step (docs/performance.md); false: the transformers forward.")
    cuda_graphs: bool = Field(True, description="On a GPU, the in-process engine replays its fast decode step from a CUDA graph (docs/performance.md).")
    compile_step: bool = Field(True, description="On a GPU, the CUDA-graph decode step is compiled by torch.compile first: fused kernels, 1.2-3x the decode tokens/s, about a minute of compiling at the first generate (docs/performance.md).")
    max_batch_tokens: int = Field(0, ge=0, description="Key/value cache tokens one decode batch of the in-process engine may claim, rows x (prompt + max_tokens); a larger call is decoded in several batches (0 = no limit).")
    threads: int = Field(
        0, ge=0, description="torch threads of the generation side (rollout thread, worker or each spawned server); "
        "0 = half the cores (shared by the servers). The trainer gets the rest."
    )
    kv_cache: Literal["static", "paged"] = Field(
        "static", description="The in-process engine's decode key/value cache: static (one buffer per call, as "
        "wide as the longest prompt + max_tokens) or paged (blocks: a group's rows share its prompt blocks, finished "
        "rows free theirs, attention reads only the written positions; docs/performance.md). Needs fast_decode.")
    kv_block_size: int = Field(16, ge=1, description="Tokens per block of the paged key/value cache.")
    paged_attention: Literal["auto", "gather", "flex"] = Field(
        "auto", description="Decode attention over the paged cache: gather (the rows' blocks gathered, then "
        "attention), flex (PyTorch FlexAttention over the blocks), auto (flex on a GPU, gather on the CPU).")
    sample_on_device: bool = Field(
        False, description="With kv_cache: paged, sample and check for end-of-sequence on the device, copying the "
        "tokens to the host every sample_chunk steps (requests with stop strings sample on the host).")
    sample_chunk: int = Field(8, ge=1, description="Decode steps between two copies of the sampled tokens to the host (sample_on_device).")

    def paged_options(self) -> dict:
        """The in-process engine's keyword arguments for the paged cache and sampling on the device."""
        return {"kv_cache": self.kv_cache, "kv_block_size": self.kv_block_size,
                "paged_attention": self.paged_attention, "sample_on_device": self.sample_on_device,
                "sample_chunk": self.sample_chunk}

    @property
    def weight_sync(self) -> str:
        """The sync method in effect (the default resolved)."""
        if self.sync is not None:
            return self.sync
        return "inprocess" if self.placement in ("colocated", "thread", "worker") else "files"


class ProxyConfig(Section):
    """Proxy mode: an agent program you already have talks to tokenmill's OpenAI endpoint
    (`http://HOST:PORT/proxy/<episode id>/v1`) and posts each episode's reward; finished episodes train the policy."""

    host: str = Field("127.0.0.1", description="Address the endpoint binds (loopback unless proxy.allow_remote).")
    port: int = Field(8011, ge=0, le=65535, description="Port of the endpoint (0 picks a free one).")
    token: str | None = Field(None, description="Bearer token the agent must send (required off loopback).")
    allow_remote: bool = Field(False, description="Allow a non-loopback proxy.host (needs proxy.token).")
    agent_command: list[str] = Field(
        default_factory=list, description="Optional agent program to start (argv; '{url}' is replaced by the "
        "endpoint's URL, '{token}' by the token); the run ends when it exits and its episodes are used up."
    )
    wait_timeout_s: float = Field(600.0, gt=0, description="Longest wait for one step's episodes before the run "
                                  "stops with a message naming what arrived.")
    episode_ttl_s: float = Field(600.0, gt=0, description="An open episode with no call for this long is dropped.")
    stepwise: bool = Field(False, description="One sample per recorded call, sharing its episode's reward and "
                           "advantage (env.stepwise), instead of one per append-only run of calls.")
    read_timeout_s: float = Field(30.0, gt=0, description="Seconds a client may take to send a request's head (and "
                                  "to pause in its body) before the endpoint closes its connection.")
    max_connections: int | None = Field(None, ge=1, description="Open connections at most; at the cap the slowest "
                                        "waiting one is closed (default: half the open-file limit, at most 1000).")


class TrackingConfig(Section):
    output_dir: str = Field("runs/tokenmill", description="Run folder: metrics.jsonl, config, checkpoints.")
    console: Literal["rich", "plain", "none"] = Field("rich", description="Progress display on the console.")
    log_every: int = Field(1, ge=1, description="Print a compact line every N steps.")
    tensorboard: bool = Field(False, description="Also write TensorBoard scalars (needs tensorboard).")
    wandb: bool = Field(False, description="Also log to Weights & Biases (needs wandb).")
    trackio: bool = Field(False, description="Also log to trackio, in $TRACKIO_DIR (needs trackio).")
    mlflow: bool = Field(False, description="Also log to MLflow at $MLFLOW_TRACKING_URI, else in output_dir/mlruns "
                         "(needs mlflow or mlflow-skinny).")
    wandb_project: str = Field("tokenmill", description="Project name on W&B and trackio, experiment on MLflow.")
    log_samples: int = Field(2, ge=0, description="Samples per step written to samples.jsonl.")


class CheckpointConfig(Section):
    every: int = Field(0, ge=0, description="Save a checkpoint every N steps (0 = only at the end).")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept; older ones are removed after a save.")
    resume: bool = Field(False, description="Continue from the newest complete checkpoint in output_dir.")
    resume_anyway: bool = Field(
        False, description="Resume even from a checkpoint of a run with another model, algorithm, data, group "
        "size or LoRA (refused by default); the differences are recorded as an event.")
    save_final: bool = Field(True, description="Save a checkpoint and an HF export at the end.")
    preempt_timeout_s: float = Field(
        20.0, ge=0, description="On SIGTERM or Ctrl-C: finish the step, save a checkpoint and exit with status 75 "
        "within this many seconds, else exit without one (143 / 130); SIGUSR1 saves one and goes on. 0: no "
        "signal handling (the signals act as on any process).")


class RLConfig(Section):
    """A whole GRPO-family run."""

    model: ModelConfig
    data: DataConfig
    env: EnvConfig | None = Field(None, description="Multi-turn environment; its episodes' returns are the reward.")
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    rewards: list[RewardConfig] = Field(
        default_factory=list, description="Reward functions / models; a built-in task adds its own."
    )
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    critic: CriticConfig = Field(
        default_factory=CriticConfig, description="Value model; used only with algorithm.advantage: gae (PPO)."
    )
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Engine placement and weight sync.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig,
                                   description="Trainer ranks and engine replicas on a Ray cluster (`tokenmill plan`).")
    proxy: ProxyConfig | None = Field(None, description="Train on episodes of an external OpenAI-API agent program.")
    distillation: DistillConfig | None = Field(None, description="On-policy distillation from teachers (advantage distill).")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    health: HealthConfig = Field(default_factory=HealthConfig, description="Run-health checks: mismatch, probe, alarms.")
    record: RecordConfig = Field(default_factory=RecordConfig, description="Rollout dumps, replay, rollout-only.")

    @property
    def sequences_per_step(self) -> int:
        """Sequences sampled and trained each step: controller.prompts_per_step x generation.group_size."""
        return self.controller.prompts_per_step * self.generation.group_size

    @model_validator(mode="after")
    def _cross_checks(self) -> RLConfig:
        _check_data_source(self)
        seqs = self.sequences_per_step
        if self.algorithm.mini_batches > seqs:
            raise ValueError(
                f"algorithm.mini_batches: algorithm.mini_batches ({self.algorithm.mini_batches}) exceeds the "
                f"sequences per step ({seqs} = controller.prompts_per_step x generation.group_size)"
            )
        if seqs > MAX_SEQUENCES:
            raise ValueError(f"controller.prompts_per_step: {seqs:,} sequences per step (controller.prompts_per_step "
                             f"x generation.group_size); at most {MAX_SEQUENCES:,}")
        if self.algorithm.advantage in GROUP_BASELINES and self.generation.group_size < 2:
            raise ValueError(
                f"generation.group_size: algorithm.advantage {self.algorithm.advantage!r} compares each completion "
                "with the others of its prompt, so a group of 1 makes every advantage 0 and nothing is learned; "
                "set generation.group_size >= 2 (or algorithm.advantage gae, PPO with a critic)"
            )
        if self.algorithm.advantage == "gae" and self.algorithm.loss == "gspo":
            raise ValueError("algorithm.loss: 'gspo' clips a sequence ratio and needs one advantage per sequence; "
                             "with algorithm.advantage 'gae' use ppo_clip or cispo")
        if self.algorithm.kl_in_reward and self.algorithm.advantage != "gae":
            raise ValueError("algorithm.kl_in_reward: only PPO (algorithm.advantage 'gae') has per-token rewards")
        _check_async(self)
        check_distill(self)
        if self.training.backend == "fsdp2" and (self.engine.placement != "colocated" or self.proxy is not None
                                                 or self.critic.lora.rank > 0):
            raise ValueError("training.backend: fsdp2 runs with engine.placement colocated (each rank samples "
                             "its share of the prompts), without proxy and without critic.lora")
        check_router_replay(self)
        if self.proxy is not None and (self.engine.placement != "colocated" or self.controller.max_staleness):
            raise ValueError("proxy: proxy mode serves the policy itself (the agent plays while the trainer trains, "
                             "one version behind); leave engine.placement colocated and controller.max_staleness 0")
        if self.algorithm.overlong_buffer >= self.generation.max_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer: algorithm.overlong_buffer ({self.algorithm.overlong_buffer}) must be "
                f"below generation.max_tokens ({self.generation.max_tokens})"
            )
        return self


def _check_data_source(cfg: RLConfig) -> None:
    """The rows come from data.task or data.path, or from the verifiers environment's taskset (then neither)."""
    data, verifiers = cfg.data, cfg.env is not None and cfg.env.verifiers is not None
    if verifiers and (data.task is not None or data.path is not None):
        raise ValueError("data: env.verifiers brings its tasks as the rows; leave data.task and data.path unset "
                         "(data.num_eval still holds tasks out for evaluation)")
    if not verifiers and data.task is None and data.path is None:
        raise ValueError("data: set exactly one of data.task or data.path")


def _check_async(cfg: RLConfig) -> None:
    """Placement, weight sync and staleness fit together (each error names the field to change)."""
    eng, ctl = cfg.engine, cfg.controller
    if eng.placement == "colocated" and ctl.max_staleness > 0:
        raise ValueError("controller.max_staleness: a colocated engine samples from the trainer's own module, so "
                         "generation cannot run ahead of training; set engine.placement to thread, worker, process or remote")
    if eng.placement == "remote" and not eng.urls:
        raise ValueError("engine.urls: engine.placement remote needs at least one server URL")
    if eng.placement != "remote" and eng.urls:
        raise ValueError(f"engine.urls: only used with engine.placement remote (placement is {eng.placement!r})")
    if eng.placement == "worker" and cfg.model.device not in ("auto", "cpu"):
        raise ValueError(f"engine.placement: worker runs its engine on the CPU (model.device is "
                         f"{cfg.model.device!r}); use thread, process or remote")
    if eng.num_servers > 1 and eng.placement != "process":
        raise ValueError("engine.num_servers: only used with engine.placement process")
    in_process = eng.placement in ("colocated", "thread", "worker")
    if in_process and eng.weight_sync != "inprocess":
        raise ValueError(f"engine.sync: an in-process engine ({eng.placement}) takes weights in process; "
                         f"{eng.weight_sync!r} is for process / remote placements")
    if not in_process and eng.weight_sync == "inprocess":
        raise ValueError(f"engine.sync: inprocess cannot reach a {eng.placement} engine; use files or broadcast")
    vllm = eng.weight_sync in ("vllm", "vllm_broadcast")
    if vllm and eng.placement != "remote":
        raise ValueError(f"engine.sync: {eng.weight_sync} is for vLLM servers at engine.urls (placement remote), "
                         f"not {eng.placement}")
    gen = cfg.generation
    if vllm and (gen.top_k or gen.top_p < 1.0):
        # vLLM's processed logprobs are renormalised over the kept tokens, not the trainer's full-vocabulary ones
        raise ValueError(f"generation.{'top_k' if gen.top_k else 'top_p'}: vLLM returns no logprobs the trainer "
                         "can compare with once top_k / top_p cut the vocabulary; keep top_k 0 and top_p 1.0")
    if ctl.partial_rollouts and eng.placement != "thread":
        raise ValueError("controller.partial_rollouts: interrupting in-flight generations is implemented for "
                         "engine.placement thread")
    if ctl.partial_rollouts and cfg.env is not None:
        raise ValueError("controller.partial_rollouts: single-turn generation only (an env episode is not "
                         "continued across weight updates)")
    if cfg.algorithm.off_policy != "none" and cfg.algorithm.loss == "gspo":
        raise ValueError("algorithm.off_policy: the correction weighs tokens; gspo clips a sequence ratio "
                         "(use ppo_clip or cispo)")

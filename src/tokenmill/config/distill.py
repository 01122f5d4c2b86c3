"""`distillation:`: on-policy distillation from one or more teachers (with `algorithm.advantage: distill`).

    algorithm:
      advantage: distill
    distillation:
      teacher: {path: runs/teacher/final}      # an HF folder loaded in this process
      kl_coef: 1.0                             # weight of the reverse KL in each token's advantage
      task_weight: 0.0                         # weight of the task reward's group advantage (0: pure distillation)
      top_k: 0                                 # 0: the teacher's logprob of each sampled token; k: its top-k only
      loss: auto                               # full: the exact reverse KL at each position; sampled: one token's

Several teachers: `teachers: {math: {url: http://127.0.0.1:8000}, code: {path: ...}}` with `route_by: task`
(each row goes to the teacher its `task` column names) or without it (every token scored by the mixture of
all of them). `routes` maps column values to teacher names (several tasks may share a teacher) and
`route_default` names the teacher of any other row.

Self-distillation (no second model): `self_teacher: {template: "The answer is {answer}. {prompt}"}`: the
policy itself, shown the row's privileged columns through the template, scores the completion it sampled
from the plain prompt.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tokenmill.config.section import DEVICE, Section


class TeacherConfig(Section):
    """One teacher: an HF causal LM in this process (`path`) or an OpenAI-compatible server that returns
    prompt logprobs (`url`: `tokenmill serve`, vLLM)."""

    path: str | None = Field(None, description="HF model folder loaded in this process (same tokenizer as the policy).")
    url: str | None = Field(None, description="OpenAI-compatible server returning prompt logprobs (http://host:port).")
    token: str | None = Field(None, description="Bearer token for `url` (default: $TOKENMILL_SERVE_TOKEN).")
    model: str = Field("tokenmill", description="Model name sent to the server at `url`.")
    device: str = Field("auto", pattern=DEVICE.pattern, description="Device of a `path` teacher (auto: the policy's).")

    @model_validator(mode="after")
    def _one_source(self) -> TeacherConfig:
        if (self.path is None) == (self.url is None):
            raise ValueError("set exactly one of path (a model in this process) or url (a server)")
        return self


class SelfTeacherConfig(Section):
    """Self-distillation (OPSD / SDFT-style): the teacher is the policy itself, prompted with privileged
    context (a reference answer, a hint) that the student's prompt does not show."""

    template: str = Field(
        ..., min_length=1, description="The teacher's prompt, a format string over the row's columns, e.g. "
        "'The answer is {answer}. {prompt}' (chat prompts: applied to the last user message, as {prompt}).")
    snapshot: Literal["policy", "initial"] = Field(
        "policy", description="policy: the current policy, scored before the step's update (a frozen snapshot "
        "of this step); initial: a frozen copy of the starting weights.")


class DistillConfig(Section):
    """On-policy distillation: the student's own samples are pushed toward the teacher by the reverse KL,
    exactly over the vocabulary at each position (`loss: full`) or by its sampled-token estimate (`sampled`)."""

    teacher: TeacherConfig | None = Field(None, description="The teacher (or give several in `teachers`).")
    teachers: dict[str, TeacherConfig] = Field(
        default_factory=dict, description="Several teachers by name: routed by `route_by`, else mixed.")
    route_by: str | None = Field(
        None, description="Data column whose value names the teacher for each row (teachers only); unset: every "
        "token is scored by the mixture (mean probability) of all teachers.")
    kl_coef: float = Field(1.0, gt=0.0, description="Weight of the reverse KL: of each token's log ratio in its "
                           "advantage (loss sampled), of the full KL term in the loss (loss full).")
    task_weight: float = Field(
        0.0, ge=0.0, description="Weight of the task reward's group advantage (GRPO) added to every token's.")
    loss: Literal["auto", "full", "sampled"] = Field(
        "auto", description="full: the exact reverse KL over the vocabulary at every position of the student's "
        "sample (over the top_k tokens plus 'other' with top_k), a loss term differentiated through the student "
        "(one `teacher`); sampled: its one-token estimate at the sampled token as a per-token advantage (any "
        "teachers); auto: full for one in-process teacher with top_k 0, else sampled (see docs/distillation.md).")
    top_k: int = Field(
        0, ge=0, le=1024, description="0: the teacher's logprob of each sampled token; k > 0: only its k most "
        "likely tokens per position, the rest bucketed as one 'other' outcome (see docs/distillation.md).")
    teacher_tokenizer: str = Field(
        "same", min_length=1, description="same: the teacher has the policy's tokenizer (checked); auto: read "
        "the teacher folder's tokenizer and, where it differs, align the two tokenizations by text spans; a "
        "folder: the teacher's tokenizer (e.g. for a `url` teacher), aligned by text spans (loss sampled).")
    routes: dict[str, str] = Field(
        default_factory=dict, description="With route_by: a rule mapping the column's values to teacher names "
        "(several values may share a teacher); a value not listed names its teacher itself.")
    route_default: str | None = Field(
        None, description="With route_by: the teacher of rows whose column names no teacher (unset: an error).")
    self_teacher: SelfTeacherConfig | None = Field(
        None, description="Self-distillation: the policy, prompted with privileged columns, is its own teacher "
        "(instead of teacher / teachers).")

    @model_validator(mode="after")
    def _teachers(self) -> DistillConfig:
        if sum((self.teacher is not None, bool(self.teachers), self.self_teacher is not None)) != 1:
            raise ValueError("set exactly one of teacher, teachers or self_teacher")
        if self.self_teacher is not None and (self.loss == "full" or self.top_k):
            raise ValueError("self_teacher: scored on its own privileged prompt, the policy's teacher side is "
                             "not at the student's positions; use loss 'sampled' (or auto) and top_k 0")
        if (self.routes or self.route_default is not None) and self.route_by is None:
            raise ValueError("routes / route_default: rules for route_by; set route_by to the routing column")
        for key, name in [*((f"routes.{k}", v) for k, v in self.routes.items()), ("route_default", self.route_default)]:
            if name is not None and name not in self.teachers:
                raise ValueError(f"{key}: {name!r} names no teacher (teachers: {', '.join(self.teachers)})")
        if self.route_by is not None and not self.teachers:
            raise ValueError("route_by: routes rows between several `teachers`; with one `teacher` leave it unset")
        if self.loss == "full" and (self.teacher is None or (self.teacher.path is None and not self.top_k)):
            raise ValueError("loss: 'full' needs one teacher's distribution at every position: a teacher loaded "
                             "in this process (teacher.path), or top_k > 0 (its k most likely tokens, from a "
                             "server too); use loss 'sampled' for several teachers")
        if self.top_k and len(self.named) > 1 and self.route_by is None:
            raise ValueError("top_k: a mixture of teachers needs each teacher's logprob of the sampled token; "
                             "use top_k 0 or route_by")
        return self

    @model_validator(mode="after")
    def _teacher_tokenizer(self) -> DistillConfig:
        if self.teacher_tokenizer == "same":
            return self
        if self.teacher is None:
            raise ValueError("teacher_tokenizer: a teacher with another tokenizer is one `teacher`; with several "
                             "`teachers` or a `self_teacher` leave it 'same'")
        if self.loss == "full":
            raise ValueError("loss: 'full' sums over one vocabulary at each position, which two tokenizers do not "
                             "share; with teacher_tokenizer set use loss 'sampled' (the log ratio of aligned text "
                             "spans) or 'auto'")
        if self.top_k:
            raise ValueError("top_k: a teacher's top-k tokens are in its own vocabulary; with teacher_tokenizer "
                             "set use top_k 0")
        if self.teacher_tokenizer == "auto" and self.teacher.path is None:
            raise ValueError("teacher_tokenizer: 'auto' reads the teacher folder's tokenizer; a `url` teacher "
                             "needs the folder of its tokenizer here")
        return self

    @property
    def full_possible(self) -> bool:
        """Whether the teacher's whole distribution is at hand: one in-process teacher, top_k 0."""
        return (self.teacher is not None and self.teacher.path is not None and not self.top_k
                and self.teacher_tokenizer == "same")

    @property
    def named(self) -> dict[str, TeacherConfig]:
        """Every teacher by name (a single `teacher` is named 'teacher'; none for a self_teacher)."""
        return {"teacher": self.teacher} if self.teacher is not None else dict(self.teachers)

    def teacher_for(self, value: Any) -> str | None:
        """The teacher of a row whose `route_by` column holds `value` (`routes`, the value itself, then
        `route_default`); None when none is named."""
        name = self.routes.get(value, value) if isinstance(value, str) else None
        return name if name in self.teachers else self.route_default


def check_distill(cfg: Any) -> None:
    """RLConfig cross-checks: `algorithm.advantage: distill` and the `distillation:` section come together;
    the per-token advantages need a per-token loss. Raises ValueError naming the field."""
    algo, dist = cfg.algorithm, cfg.distillation
    if algo.advantage == "distill" and dist is None:
        raise ValueError("distillation: algorithm.advantage 'distill' needs a distillation section with a teacher")
    if dist is None:
        return
    if algo.advantage != "distill":
        raise ValueError(f"algorithm.advantage: a distillation section trains with advantage 'distill', "
                         f"not {algo.advantage!r}")
    if algo.loss == "gspo":
        raise ValueError("algorithm.loss: 'gspo' clips a sequence ratio; distillation's advantages are per "
                         "token (use ppo_clip or cispo)")
    if dist.loss == "full" and cfg.training.backend != "local":
        raise ValueError("distillation.loss: 'full' computes the teacher's distribution inside the local "
                         "trainer; with training.backend 'fsdp2' set loss 'sampled'")
    if dist.teacher_tokenizer != "same" and (cfg.env is not None or cfg.proxy is not None):
        raise ValueError("distillation.teacher_tokenizer: a teacher with another tokenizer re-renders single-turn "
                         "prompts; multi-turn environments keep the same tokenizer ('same')")
    if dist.self_teacher is not None and (cfg.training.backend != "local" or cfg.cluster.backend == "ray"):
        raise ValueError("distillation.self_teacher: the policy scores as its own teacher with the trainer's module "
                         "in this process; with training.backend 'fsdp2' or cluster.backend 'ray' it is not "
                         "available yet (use the local trainer)")
    if dist.task_weight > 0 and cfg.generation.group_size < 2:
        raise ValueError("generation.group_size: distillation.task_weight > 0 mixes in the group advantage of "
                         "the task reward, which needs generation.group_size >= 2")


def full_kl(cfg: Any) -> bool:
    """Whether a run distils with the full reverse KL: `loss: full`, or `auto` where the teacher's whole
    distribution is at hand and the trainer is the local one (fsdp2 and servers fall back to `sampled`)."""
    dist = cfg.distillation
    if dist is None or dist.loss == "sampled":
        return False
    return dist.loss == "full" or (dist.full_possible and cfg.training.backend == "local")

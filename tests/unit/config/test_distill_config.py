"""The `distillation:` section and `algorithm.advantage: distill` are validated together, each error naming
the field to change."""

from __future__ import annotations

import pytest

from tokenmill.config import RLConfig, load_config
from tokenmill.types import ConfigError

BASE = {"model": {"path": "m"}, "data": {"task": "addition"}}
DISTILL = {"algorithm": {"advantage": "distill"}, "distillation": {"teacher": {"path": "t"}}}


def _load(**sections):
    return load_config(RLConfig, BASE | sections)


def test_a_distillation_run_validates_with_its_defaults():
    cfg = _load(**DISTILL, generation={"group_size": 1})  # pure distillation needs no group
    d = cfg.distillation
    assert (d.kl_coef, d.task_weight, d.top_k, d.named["teacher"].path) == (1.0, 0.0, 0, "t")


@pytest.mark.parametrize(("sections", "message"), [
    ({"algorithm": {"advantage": "distill"}}, "distillation: algorithm.advantage 'distill' needs a distillation"),
    ({"distillation": {"teacher": {"path": "t"}}}, "algorithm.advantage: a distillation section trains with"),
    ({**DISTILL, "algorithm": {"advantage": "distill", "loss": "gspo"}}, "algorithm.loss: 'gspo' clips a sequence"),
    ({**DISTILL, "distillation": {"teacher": {"path": "t"}, "task_weight": 0.5}, "generation": {"group_size": 1}},
     "generation.group_size: distillation.task_weight > 0"),
    ({**DISTILL, "distillation": {}}, "distillation: set exactly one of teacher, teachers or self_teacher"),
    ({**DISTILL, "distillation": {"teacher": {"path": "t"}, "self_teacher": {"template": "{prompt}"}}},
     "distillation: set exactly one of teacher, teachers or self_teacher"),
    ({**DISTILL, "distillation": {"self_teacher": {"template": "{answer} {prompt}"}, "loss": "full"}},
     "distillation: self_teacher: scored on its own privileged prompt"),
    ({**DISTILL, "distillation": {"self_teacher": {"template": ""}}}, "distillation.self_teacher.template"),
    ({**DISTILL, "distillation": {"self_teacher": {"template": "{prompt}"}}, "training": {"backend": "fsdp2"}},
     "distillation.self_teacher: the policy scores as its own teacher"),
    ({**DISTILL, "distillation": {"teacher": {"path": "t", "url": "http://127.0.0.1:1"}}},
     "distillation.teacher: set exactly one of path"),
    ({**DISTILL, "distillation": {"teacher": {"path": "t"}, "route_by": "task"}}, "distillation: route_by: routes"),
    ({**DISTILL, "distillation": {"teachers": {"a": {"path": "t"}, "b": {"path": "u"}}, "top_k": 5}},
     "distillation: top_k: a mixture of teachers"),
    ({**DISTILL, "distillation": {"teacher": {"path": "t"}, "kl_coef": 0}}, "distillation.kl_coef"),
])
def test_bad_distillation_configs_name_the_field(sections, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        _load(**sections)

"""`distillation.teacher_tokenizer`: a teacher with another tokenizer takes the sampled estimate on aligned
text spans; the full KL, top-k lists, several teachers, `auto` on a server and multi-turn environments are
refused naming the field, and `loss: auto` falls back to `sampled`."""

from __future__ import annotations

import pytest

from tokenmill.config import RLConfig, load_config
from tokenmill.config.distill import full_kl
from tokenmill.types import ConfigError

BASE = {"model": {"path": "m"}, "data": {"task": "addition"}, "algorithm": {"advantage": "distill"}}


def _load(distillation, **sections):
    return load_config(RLConfig, BASE | {"distillation": distillation} | sections)


def test_same_is_the_default_and_auto_picks_the_sampled_estimate():
    cfg = _load({"teacher": {"path": "t"}})
    assert cfg.distillation.teacher_tokenizer == "same" and full_kl(cfg)
    for choice in ("auto", "runs/teacher-tokenizer"):
        cfg = _load({"teacher": {"path": "t"}, "teacher_tokenizer": choice})
        assert cfg.distillation.teacher_tokenizer == choice and not full_kl(cfg)
    assert _load({"teacher": {"url": "http://127.0.0.1:1"}, "teacher_tokenizer": "tok"}).distillation.teacher.url


@pytest.mark.parametrize(("distillation", "sections", "message"), [
    ({"teacher": {"path": "t"}, "teacher_tokenizer": "auto", "loss": "full"}, {},
     "distillation: loss: 'full' sums over one vocabulary"),
    ({"teacher": {"path": "t"}, "teacher_tokenizer": "auto", "top_k": 5}, {},
     "distillation: top_k: a teacher's top-k tokens are in its own vocabulary"),
    ({"teachers": {"a": {"path": "t"}, "b": {"path": "u"}}, "teacher_tokenizer": "auto"}, {},
     "distillation: teacher_tokenizer: a teacher with another tokenizer is one `teacher`"),
    ({"teacher": {"url": "http://127.0.0.1:1"}, "teacher_tokenizer": "auto"}, {},
     "distillation: teacher_tokenizer: 'auto' reads the teacher folder's tokenizer"),
    ({"teacher": {"path": "t"}, "teacher_tokenizer": ""}, {}, "distillation.teacher_tokenizer"),
    ({"teacher": {"path": "t"}, "teacher_tokenizer": "auto"}, {"env": {"name": "guess_number"}},
     "distillation.teacher_tokenizer: a teacher with another tokenizer re-renders single-turn"),
    ({"teacher": {"path": "t"}, "teacher_tokenizer": "auto"}, {"proxy": {}},
     "distillation.teacher_tokenizer: a teacher with another tokenizer re-renders single-turn"),
])
def test_refusals_name_the_field(distillation, sections, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        _load(distillation, **sections)

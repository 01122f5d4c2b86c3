"""The Composer's RL form has the distillation routing, self-distillation and teacher-tokenizer fields, in the advanced level
and the Distillation group, with the schema's types and defaults."""

from __future__ import annotations


def test_the_rl_form_has_the_distillation_routing_and_self_teacher_fields():
    from tokenmill.composer.schema_ui import schema_response

    body = schema_response("rl")
    fields = {f["path"]: f for f in body["fields"]}
    for path in ("distillation.route_by", "distillation.routes", "distillation.route_default",
                 "distillation.self_teacher.template", "distillation.self_teacher.snapshot",
                 "distillation.teacher_tokenizer"):
        assert (fields[path]["level"], fields[path]["group"]) == ("advanced", "distillation"), path
    assert (fields["distillation.routes"]["type"], fields["distillation.routes"]["default"]) == ("object", {})
    snapshot = fields["distillation.self_teacher.snapshot"]
    assert (snapshot["enum"], snapshot["default"]) == (["policy", "initial"], "policy")
    assert fields["distillation.self_teacher.template"]["optional_section"] == "distillation"  # the whole section is optional
    assert fields["distillation.teacher_tokenizer"]["default"] == "same"
    assert "Distillation" in [g["title"] for g in body["groups"]]

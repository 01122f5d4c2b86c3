"""The Composer's form composes a vision-language run: the image column, the remote-image switch and the
vision tower's switch are fields of the RL form, and `shapes` is among the tasks it offers."""

from __future__ import annotations


def test_the_rl_form_has_the_vision_fields():
    from tokenmill.composer.schema_ui import schema_fields

    fields = {f["path"]: f for f in schema_fields("rl")}
    assert (fields["model.freeze_vision"]["type"], fields["model.freeze_vision"]["default"]) == ("boolean", True)
    assert (fields["data.image_column"]["type"], fields["data.image_column"]["default"]) == ("string", "images")
    assert fields["data.allow_remote_images"]["default"] is False
    assert "shapes" in fields["data.task"]["enum"]

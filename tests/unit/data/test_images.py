"""Prompts with images in the formats users have; a bad image is refused with the row and the file named."""

from __future__ import annotations

import base64
import io

import pytest

from tokenmill.data.images import ImageError, ImagePolicy, load_image, row_images, split_images

Image = pytest.importorskip("PIL.Image")


def _png(colour=(255, 0, 0), size=(8, 6)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def test_trl_images_column_fills_image_parts_in_order():
    red, blue = Image.new("RGB", (4, 4), (255, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 255))
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}, {"type": "image"}]}]
    messages, refs = split_images(prompt, [red, blue])
    assert refs == [red, blue]
    assert [p["type"] for p in messages[0]["content"]] == ["image", "text", "image"]


def test_images_without_slots_go_first_in_the_first_user_message():
    """TRL's convention: a prompt without image parts gets its images at the start of the first user turn."""
    picture = Image.new("RGB", (4, 4))
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "how many?"}]
    messages, refs = split_images(prompt, picture)
    assert refs == [picture]
    assert messages[0]["content"] == [{"type": "text", "text": "be brief"}]
    assert messages[1]["content"] == [{"type": "image"}, {"type": "text", "text": "how many?"}]


def test_openai_image_url_parts_from_files_and_data_urls(tmp_path):
    path = tmp_path / "cat.png"
    path.write_bytes(_png((0, 255, 0)))
    data_url = "data:image/png;base64," + base64.b64encode(_png((0, 0, 255))).decode()
    row = {"prompt": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": str(path)}},
        {"type": "image_url", "image_url": {"url": data_url}},
        {"type": "text", "text": "which is blue?"}]}]}
    messages, images, sources = row_images(row, "prompt", "images", ImagePolicy(), "row 0")
    assert [im.getpixel((0, 0)) for im in images] == [(0, 255, 0), (0, 0, 255)]
    assert messages[0]["content"][:2] == [{"type": "image"}, {"type": "image"}]
    assert sources[0] == repr(str(path))


def test_a_datasets_image_value_and_file_urls(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(_png())
    assert load_image({"bytes": _png((1, 2, 3)), "path": None}).getpixel((0, 0)) == (1, 2, 3)
    assert load_image(f"file://{path}").size == (8, 6)
    assert load_image(Image.new("L", (3, 3))).mode == "RGB"


def test_missing_corrupt_and_oversized_images_name_the_row_and_the_file(tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png at all")
    with pytest.raises(ImageError, match=r"row 7: image '.*missing\.png': no such file"):
        load_image(str(tmp_path / "missing.png"), where="row 7")
    with pytest.raises(ImageError, match=r"row 2: image '.*broken\.png': cannot identify image file"):
        load_image(str(broken), where="row 2")
    big = tmp_path / "big.png"
    big.write_bytes(_png(size=(100, 50)))
    with pytest.raises(ImageError, match=r"100x50 pixels is more than data.max_image_pixels \(4000\)"):
        load_image(str(big), ImagePolicy(max_pixels=4000), where="row 1")


def test_a_remote_url_is_refused_unless_allowed():
    with pytest.raises(ImageError, match="remote image URL; set data.allow_remote_images: true"):
        load_image("https://example.com/cat.png", where="row 0")


def test_a_remote_url_is_fetched_when_allowed():
    """Served on loopback by a real HTTP server."""
    import http.server
    import threading

    body = _png((9, 9, 9))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # the stdlib's name
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/x.png"
        assert load_image(url, ImagePolicy(allow_remote=True)).getpixel((0, 0)) == (9, 9, 9)
    finally:
        server.shutdown()


def test_too_few_images_for_the_slots_is_the_rows_error():
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}]
    with pytest.raises(ImageError, match="row 4: message 0: an image part with no image"):
        row_images({"prompt": prompt, "images": [Image.new("RGB", (2, 2))]}, "prompt", "images", ImagePolicy(),
                   "row 4")


def test_logged_prompts_name_their_images_instead_of_holding_them():
    import json

    from tokenmill.data.images import printable

    data_url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    prompt = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (2, 2))},
                                           {"type": "image_url", "image_url": {"url": data_url}},
                                           {"type": "image"}, {"type": "text", "text": "hi"}]}]
    shown = printable(prompt)
    assert shown[0]["content"] == [{"type": "image", "image": "Image"},
                                   {"type": "image", "image": repr(data_url[:40] + "...")},
                                   {"type": "image"}, {"type": "text", "text": "hi"}]
    assert len(json.dumps(shown)) < 300

"""Images of every PIL mode reach the processor as RGB with their values scaled (a 16-bit PNG is
not all white, transparency is white as HF's processors make it); broken, empty, mislabelled and
huge files are bad samples named by file (and, huge, by size and `data.max_image_pixels`);
`ds-omni data check` flags an image whose pixels all have one value."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ds_omni.cli import main
from ds_omni.data.media import DEFAULT_MAX_IMAGE_PIXELS, image_size, load_image
from ds_omni.errors import DataError
from tests.bad_input.common import config, says, write
from tests.data_files import conversation_rows
from tests.data_files import write as write_layout

W, H = 64, 8
RAMP = np.tile(np.arange(W), (H, 1))  # [H, W]: 0 .. W-1 left to right


def _ramp(top: float, dtype) -> np.ndarray:
    return (RAMP * (top / (W - 1))).astype(dtype)


def _half_clear(mode: str, base: str):
    """`base` gradient with the left half fully transparent (alpha 0), as `mode`."""
    gray = Image.fromarray(_ramp(255, np.uint8), "L")
    alpha = Image.fromarray(np.where(RAMP < W // 2, 0, 255).astype(np.uint8), "L")
    im = gray.convert(base)
    im.putalpha(alpha)
    return im.convert(mode) if mode != im.mode else im


def _palette_transparent():
    im = Image.fromarray(_ramp(255, np.uint8), "L").convert("P")
    im.info["transparency"] = im.getpixel((0, 0))  # the left edge's colour is see-through
    return im


MODES = {  # name: (image, file format, (lowest, highest) red value expected, transparent left)
    "L": (lambda: Image.fromarray(_ramp(255, np.uint8), "L"), "PNG", (0, 255), False),
    "I;16 png": (lambda: Image.fromarray(_ramp(65535, np.uint16)), "PNG", (0, 255), False),
    "I;16 dark png": (lambda: Image.fromarray(_ramp(4095, np.uint16)), "PNG", (0, 16), False),
    "I;16B tiff": (lambda: Image.frombytes("I;16B", (W, H),
                                           _ramp(65535, np.uint16).astype(">u2").tobytes()),
                   "TIFF", (0, 255), False),
    "I 16-bit values": (lambda: Image.fromarray(_ramp(65535, np.int32), "I"), "TIFF",
                        (0, 255), False),
    "I wide range": (lambda: Image.fromarray(_ramp(10 ** 7, np.int32) - 5000, "I"), "TIFF",
                     (0, 255), False),
    "F 0..1": (lambda: Image.fromarray(_ramp(1.0, np.float32), "F"), "TIFF", (0, 255), False),
    "F wide": (lambda: Image.fromarray(_ramp(3000.0, np.float32) - 1000, "F"), "TIFF",
               (0, 255), False),
    "1": (lambda: Image.fromarray(RAMP >= W // 2), "PNG", (0, 255), False),
    "P": (lambda: Image.fromarray(_ramp(255, np.uint8), "L").convert("P"), "PNG", (0, 255), False),
    "P transparency": (_palette_transparent, "PNG", (128, 255), True),
    "RGBA": (lambda: _half_clear("RGBA", "RGB"), "PNG", (128, 255), True),
    "LA": (lambda: _half_clear("LA", "L"), "PNG", (128, 255), True),
    "PA": (lambda: _half_clear("RGBA", "L").convert("PA"), "TIFF", (128, 255), True),
    "CMYK": (lambda: Image.fromarray(_ramp(255, np.uint8), "L").convert("CMYK"), "TIFF",
             (0, 255), False),
    "YCbCr": (lambda: Image.fromarray(_ramp(255, np.uint8), "L").convert("YCbCr"), "TIFF",
              (0, 255), False),
}


@pytest.mark.parametrize("name", sorted(MODES))
def test_every_pil_mode_becomes_rgb_scaled_not_clipped(tmp_path, name):
    make, fmt, (lo, hi), transparent = MODES[name]
    path = tmp_path / f"image.{fmt.lower()}"
    make().save(path, fmt)
    rgb = np.asarray(load_image(str(path)))
    assert rgb.shape == (H, W, 3) and rgb.dtype == np.uint8
    red = rgb[..., 0].astype(int)
    seen = red[:, W // 2:] if transparent else red  # the opaque half
    assert abs(seen.min() - lo) <= 2 and abs(seen.max() - hi) <= 2, (seen.min(), seen.max())
    assert (np.diff(seen, axis=1) >= 0).all()  # the ramp keeps its order: scaled, not clipped
    if transparent:
        assert (rgb[:, 0] == 255).all()  # see-through is white, as HF's convert_to_rgb makes it


BROKEN = {  # name: (file name, bytes, words of the error)
    "truncated png": ("a.png", lambda png: png[: len(png) // 2], ["unreadable image", "a.png"]),
    "zero bytes": ("a.png", lambda png: b"", ["unreadable image", "a.png", "cannot identify"]),
    "text named png": ("a.png", lambda png: b"hello, not an image", ["unreadable image",
                                                                      "a.png"]),
    "png named jpg": ("a.jpg", lambda png: png, None),  # read by its content: fine
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_or_mislabelled_image_files(tmp_path, name):
    file, body, words = BROKEN[name]
    buf = io.BytesIO()
    Image.fromarray(_ramp(255, np.uint8), "L").save(buf, "PNG")
    path = tmp_path / file
    path.write_bytes(body(buf.getvalue()))
    if words is None:
        assert load_image(str(path)).size == (W, H)
        return
    with pytest.raises(DataError) as e:
        load_image(str(path))
    says(str(e.value), *words)


def test_image_past_pils_limit_is_refused_before_decoding(tmp_path):
    """10000 x 9000 = 90 M pixels, PIL's limit 89.5 M: said by size and field, not PIL's bomb
    error; the limit is the config's to raise."""
    path = tmp_path / "huge.png"
    Image.new("1", (10000, 9000)).save(path)
    for read in (load_image, image_size):
        with pytest.raises(DataError) as e:
            read(str(path), DEFAULT_MAX_IMAGE_PIXELS)
        says(str(e.value), "huge.png", "10000 x 9000 = 90000000 pixels",
             "data.max_image_pixels=89478485", "raise data.max_image_pixels")
    assert image_size(str(path), 10 ** 8) == (10000, 9000)


def _check(tmp_path, capsys, rows_dir: Path, on_bad_sample="skip", **data) -> dict:
    path, schema = write_layout("json", conversation_rows(3), rows_dir, files=1)
    cfg = config(tmp_path / "out")
    cfg["data"]["sources"] = [{"name": "s", "path": path, "schema": schema,
                               "on_bad_sample": on_bad_sample}]
    cfg["data"].update(data)
    c, _ = write(tmp_path, cfg)
    code = main(["data", "check", "--config", c, "--json", "--no-progress"])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return {"code": code, **json.loads(captured.out)["sources"]["s"]} if code != 2 else \
        {"code": code, "err": captured.err}


def test_data_check_names_the_sample_file_size_and_field_of_a_huge_image(tmp_path, capsys):
    report = _check(tmp_path, capsys, tmp_path / "d", max_image_pixels=1000)  # shapes: 32 x 32
    assert report["code"] == 1 and report["bad_rows"] == 3  # all bad: an error even under skip
    message = json.dumps(report["examples"])
    says(message, "s/r0", "r0.png", "32 x 32 = 1024 pixels", "data.max_image_pixels=1000")


def test_data_check_flags_a_blank_image_and_not_a_16_bit_one(tmp_path, capsys):
    folder = tmp_path / "d"
    report = _check(tmp_path, capsys, folder)
    images = folder / "images"
    Image.new("RGB", (64, 64), (255, 255, 255)).save(images / "r0.png")  # blank
    Image.fromarray(_ramp(65535, np.uint16)).save(images / "r1.png")  # 16 bits, full range
    before = report
    report = _check(tmp_path, capsys, tmp_path / "d2")
    assert before["blank_images"]["count"] == report["blank_images"]["count"] == 0
    path, schema = str(folder / "*.jsonl"), {"text": "conversations", "image": "image",
                                             "root": str(images)}
    cfg = config(tmp_path / "out")
    cfg["data"]["sources"] = [{"name": "s", "path": path, "schema": schema}]
    c, _ = write(tmp_path, cfg)
    assert main(["data", "check", "--config", c, "--no-progress"]) == 0
    out = capsys.readouterr().out
    says(out, "blank images: 1", "s/r0: every pixel of the image", "r0.png", "replace it")
    assert "r1.png" not in out

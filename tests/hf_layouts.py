"""Datasets in the layouts the HF ecosystem writes, through `datasets` itself (list and struct
columns, Image features as {"bytes", "path"} structs): chat messages with typed content parts
(TRL's vision SFT), The Cauldron's `images` + `texts`, a hub snapshot folder (parquet shards and a
README whose YAML front matter lists configs and splits), and an InternVL meta JSON."""

from __future__ import annotations

import io
import json
from pathlib import Path

QUESTIONS = ["What colour is the square?", "Describe the picture.", "And the circle next to it?"]
ANSWERS = ["It is red.", "A small green triangle on a white background.",
           "The circle is blue, and larger."]


def image_bytes(width: int, fmt: str = "PNG", colour=(200, 30, 30)) -> bytes:
    from PIL import Image
    out = io.BytesIO()
    Image.new("RGB", (width, 16), colour).save(out, format=fmt)
    return out.getvalue()


def part_rows(n: int, jpeg: bool = False) -> list[dict]:
    """Rows {"id", "messages", "images"}: row i has 1 + i % 2 images (widths 16, 24, ...), its
    image parts before the question (two-image rows: one before, one after)."""
    rows = []
    for i in range(n):
        count = 1 + i % 2
        images = [{"bytes": image_bytes(16 + 8 * ((i + k) % 3), "JPEG" if jpeg else "PNG"),
                   "path": None} for k in range(count)]
        user = [{"type": "image"}, {"type": "text", "text": QUESTIONS[i % 3]}]
        if count == 2:
            user.append({"type": "image"})
        rows.append({"id": f"m{i}", "images": images, "messages": [
            {"role": "user", "content": user},
            {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[i % 3]}]}]})
    return rows


def cauldron_rows(n: int) -> list[dict]:
    """The Cauldron's rows: {"images", "texts": [{"user", "assistant", "source"}]}, no markers."""
    return [{"images": [{"bytes": image_bytes(16 + 8 * (i % 3)), "path": None}],
             "texts": [{"user": QUESTIONS[(i + k) % 3], "assistant": ANSWERS[(i + k) % 3],
                        "source": "shapes"} for k in range(1 + i % 2)]} for i in range(n)]


def _features(kind: str):
    import datasets as d
    text = {"text": d.Value("string")}
    if kind == "parts":
        return d.Features({"id": d.Value("string"), "images": d.List(d.Image()), "messages": d.List(
            {"role": d.Value("string"), "content": d.List({"type": d.Value("string"), **text})})})
    return d.Features({"images": d.List(d.Image()), "texts": d.List(
        {"user": d.Value("string"), "assistant": d.Value("string"), "source": d.Value("string")})})


def write_parquet(rows: list[dict], kind: str, path: Path) -> Path:
    """`rows` as `datasets` writes them to parquet (kind "parts" or "cauldron")."""
    import datasets
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows, features=_features(kind)).to_parquet(str(path))
    return path


def write_hub_folder(out: Path, n: int = 8) -> Path:
    """A hub dataset snapshot: configs "parts" (train: 2 shards, test) and "cauldron" (train)."""
    rows = part_rows(n)
    write_parquet(rows[: n // 2], "parts", out / "parts" / "train-00000-of-00002.parquet")
    write_parquet(rows[n // 2:], "parts", out / "parts" / "train-00001-of-00002.parquet")
    write_parquet(part_rows(2), "parts", out / "parts" / "test-00000-of-00001.parquet")
    write_parquet(cauldron_rows(n), "cauldron", out / "cauldron" / "train-00000.parquet")
    (out / "README.md").write_text(
        "---\nconfigs:\n- config_name: parts\n  default: true\n  data_files:\n"
        "  - split: train\n    path: parts/train-*\n  - split: test\n    path: parts/test-*\n"
        "- config_name: cauldron\n  data_files:\n  - split: train\n    path: cauldron/train-*\n"
        "---\n# shapes\n")
    return out


def write_internvl_meta(out: Path, n: int = 6) -> Path:
    """An InternVL meta JSON naming two LLaVA-format jsonl annotations with image roots."""
    from tests.data_layouts import llava_rows
    meta = {}
    for name, repeat in (("shapes_a", 1), ("shapes_b", 2)):
        folder = out / name
        rows = llava_rows(n, folder, text_only_every=0)
        (folder / "ann.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        meta[name] = {"root": str(folder), "annotation": str(folder / "ann.jsonl"),
                      "data_augment": False, "repeat_time": repeat, "length": n}
    path = out / "meta.json"
    path.write_text(json.dumps(meta))
    return path

"""Small local datasets in every supported format, written from seeds (for the data tests)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from ds_omni.data.demo import shapes_rows

FORMATS = ["parquet", "json", "arrow", "webdataset", "disk"]


def conversation_rows(n: int, seed: int = 0, prefix: str = "r") -> list[dict]:
    """Image + conversation rows (shapes demo), with ids `<prefix><i>`."""
    rows = shapes_rows(n, seed)
    for i, row in enumerate(rows):
        row["id"] = f"{prefix}{i}"
    return rows


def text_rows(n: int, prefix: str = "t") -> list[dict]:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    return [{"id": f"{prefix}{i}", "text": " ".join(words[: 2 + i % 9]) + f" {i}."} for i in range(n)]


def write(fmt: str, rows: list[dict], out: Path, files: int = 2) -> tuple[str, dict]:
    """Write `rows` as `fmt` under `out`; returns (path for SourceConfig, schema dict)."""
    out.mkdir(parents=True, exist_ok=True)
    parts = [rows[i::files] for i in range(files)] if fmt not in ("disk",) else [rows]
    has_image = "image" in rows[0]
    schema = {"text": "conversations" if has_image else "text", "image": "image" if has_image else None}
    if fmt == "json":
        return _write_jsonl(parts, out, has_image, schema)
    if fmt == "webdataset":
        return _write_tar(parts, out, has_image)
    if fmt == "disk":
        _dataset(rows, has_image).save_to_disk(str(out / "ds"))
        return str(out / "ds"), schema
    for k, part in enumerate(parts):
        ds = _dataset(part, has_image)
        if fmt == "parquet":
            ds.to_parquet(str(out / f"part-{k}.parquet"))
        else:  # arrow: the .arrow file save_to_disk writes
            ds.save_to_disk(str(out / f"tmp{k}"))
            src = next((out / f"tmp{k}").glob("*.arrow"))
            src.rename(out / f"part-{k}.arrow")
    return str(out / f"*.{'parquet' if fmt == 'parquet' else 'arrow'}"), schema


def _dataset(rows: list[dict], has_image: bool):
    import datasets
    features = {"id": datasets.Value("string")}
    if has_image:
        features.update(image=datasets.Image(), conversations=datasets.List(
            {"from": datasets.Value("string"), "value": datasets.Value("string")}))
    else:
        features["text"] = datasets.Value("string")
    return datasets.Dataset.from_list(rows, features=datasets.Features(features))


def _write_jsonl(parts, out: Path, has_image: bool, schema: dict):
    """jsonl with images as PNG files, referenced by paths relative to schema.root."""
    (out / "images").mkdir(exist_ok=True)
    for k, part in enumerate(parts):
        lines = []
        for row in part:
            row = dict(row)
            if has_image:
                name = f"{row['id']}.png"
                (out / "images" / name).write_bytes(row["image"]["bytes"])
                row["image"] = name
            lines.append(json.dumps(row))
        (out / f"part-{k}.jsonl").write_text("\n".join(lines) + "\n")
    return str(out / "*.jsonl"), {**schema, "root": str(out / "images")}


def _write_tar(parts, out: Path, has_image: bool):
    for k, part in enumerate(parts):
        with tarfile.open(out / f"shard-{k}.tar", "w") as tf:
            for row in part:
                body = {"id": row["id"]}
                body.update({"conversations": row["conversations"]} if has_image else
                            {"text": row["text"]})
                members = {f"{row['id']}.json": json.dumps(body).encode()}
                if has_image:
                    members[f"{row['id']}.png"] = row["image"]["bytes"]
                for name, data in members.items():
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    text = "json.conversations" if has_image else "json.text"
    return str(out / "*.tar"), {"text": text, "image": "png" if has_image else None, "id": "json.id"}


def write_video(path: Path, frames: int, width: int, height: int, fps: int = 4, seed: int = 0,
                codec: str = "mpeg4") -> Path:
    """A video of random RGB frames from `seed` (mp4/mpeg4: the container stores the frame count;
    mkv/ffv1: lossless, and it doesn't, so readers count packets)."""
    import av
    import numpy as np
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p" if codec == "mpeg4" else "bgr0"
        for _ in range(frames):
            image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())
    return path


def skewed_source(out: Path, *, audio: bool = False, dp: int = 2, rows: int = 32,
                  seed: int = 0, text_rows: tuple[int, ...] = ()) -> dict:
    """A parquet source whose rows that data-parallel rank 0 reads (in loader order, epoch 0)
    carry a picture (and, with `audio`, a clip of beeps), and whose other ranks' rows are text
    alone: every round, rank 0 holds all the encoder work. The media rows sit in the chunks that
    `rank_chunks` deals to rank 0 (the loader fits the source into 4 chunks per rank).
    `text_rows`: rows (by number) of rank 0's that are text too, so that a micro-batch of its
    can carry one item alone (under SP, "auto" long-short then splits it over the row's group)."""
    import random

    import datasets

    from ds_omni.data.demo import TONE_QUESTION, _beeps
    from ds_omni.data.stream import rank_chunks
    per_chunk = rows // (dp * 4)
    media_chunks = set(rank_chunks(rows // per_chunk, seed, 0, 0, 0, dp))
    rng = random.Random(seed)
    out_rows = []
    for i, row in enumerate(shapes_rows(rows, seed)):
        row["id"] = f"skew{i}"
        if audio:
            row["audio"] = {"bytes": _beeps(1 + i % 3, "low", rng), "path": None}
            row["conversations"][0]["value"] = f"<image>\n<audio>\n{TONE_QUESTION}"
        if i // per_chunk not in media_chunks or i in text_rows:
            row.update(image=None, conversations=[
                {"from": "human", "value": f"Say sentence {i}."},
                {"from": "gpt", "value": f"A plain sentence number {i} with no picture."}])
            if audio:
                row["audio"] = None
        out_rows.append(row)
    features = {"id": datasets.Value("string"), "image": datasets.Image(),
                "conversations": datasets.List({"from": datasets.Value("string"),
                                                "value": datasets.Value("string")})}
    if audio:
        features["audio"] = {"bytes": datasets.Value("binary"), "path": datasets.Value("string")}
    out.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(out_rows, features=datasets.Features(features)).to_parquet(
        str(out / "skewed.parquet"))
    return {"name": "skewed", "path": str(out / "skewed.parquet"),
            "schema": {"text": "conversations", "image": "image",
                       "audio": "audio" if audio else None}}

"""Datasets in the layouts users have them, with the usual mistakes, written locally from seeds:
a LLaVA-Instruct JSON array with relative image paths (and text-only rows), a JSON object holding
the list, a webdataset tar mixing image and text-only samples, corrupt / missing / very wide
images, a conversation stored as a JSON string, an all-bad source."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from tests.data_files import conversation_rows

TEXT_ONLY = [{"from": "human", "value": "Say hello."}, {"from": "gpt", "value": "Hello."}]


def png(width: int, height: int, colour=(200, 30, 30)) -> bytes:
    from PIL import Image
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def llava_rows(n: int, out: Path, *, text_only_every: int = 4, folder: str = "images") -> list[dict]:
    """LLaVA-Instruct rows: {"id", "image": "<folder>/<id>.png", "conversations"}; every
    `text_only_every`-th row has no image key (as in llava_v1_5_mix665k.json)."""
    (out / folder).mkdir(parents=True, exist_ok=True)
    rows = []
    for i, row in enumerate(conversation_rows(n)):
        if text_only_every and i % text_only_every == text_only_every - 1:
            rows.append({"id": row["id"], "conversations": TEXT_ONLY})
            continue
        (out / folder / f"{row['id']}.png").write_bytes(row["image"]["bytes"])
        rows.append({"id": row["id"], "image": f"{folder}/{row['id']}.png",
                     "conversations": row["conversations"]})
    return rows


def write_llava_json(out: Path, n: int = 12, key: str | None = None, **kw) -> tuple[Path, list]:
    """A LLaVA JSON array file (or an object {"info": ..., key: [...]}) under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    rows = llava_rows(n, out, **kw)
    doc = rows if key is None else {"info": {"version": 1, "tags": ["a"]}, key: rows}
    path = out / "llava.json"
    path.write_text(json.dumps(doc, indent=1))
    return path, rows


def write_webdataset(out: Path, n: int = 8) -> Path:
    """A tar whose samples alternate image + json and json only (keys without dots)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "shard-0.tar"
    with tarfile.open(path, "w") as tf:
        for i, row in enumerate(conversation_rows(n)):
            text_only = i % 2 == 1
            body = {"id": row["id"], "conversations": TEXT_ONLY if text_only else row["conversations"]}
            members = {f"s{i:04d}.json": json.dumps(body).encode()}
            if not text_only:
                members[f"s{i:04d}.jpg"] = row["image"]["bytes"]
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


def write_problem_json(out: Path) -> tuple[Path, dict]:
    """One JSON array with one row of each problem; returns (path, id -> problem kind)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "img").mkdir(exist_ok=True)
    good = conversation_rows(2)
    (out / "img" / "ok.png").write_bytes(good[0]["image"]["bytes"])
    (out / "img" / "corrupt.png").write_bytes(b"\x89PNG not really")
    (out / "img" / "wide.png").write_bytes(png(400, 8))
    conv = good[0]["conversations"]
    rows = [
        {"id": "ok", "image": "img/ok.png", "conversations": conv},
        {"id": "text", "conversations": TEXT_ONLY},
        {"id": "missing", "image": "img/nope.png", "conversations": conv},
        {"id": "corrupt", "image": "img/corrupt.png", "conversations": conv},
        {"id": "markers", "conversations": conv},  # an <image> marker, no image
        {"id": "jsonstr", "conversations": json.dumps(TEXT_ONLY)},
        {"id": "long", "conversations": [{"from": "human", "value": "word " * 400},
                                         {"from": "gpt", "value": "ok"}]},
        {"id": "wide", "image": "img/wide.png", "conversations": conv},
    ]
    path = out / "problems.json"
    path.write_text(json.dumps(rows))
    return path, {"missing": "media_missing", "corrupt": "media_unreadable",
                  "markers": "markers", "jsonstr": "conversation_string", "long": "overlong"}


def write_all_bad(out: Path, n: int = 6) -> Path:
    """Rows whose images are all missing."""
    out.mkdir(parents=True, exist_ok=True)
    conv = conversation_rows(1)[0]["conversations"]
    path = out / "bad.json"
    path.write_text(json.dumps([{"id": f"b{i}", "image": f"gone/{i}.png", "conversations": conv}
                                for i in range(n)]))
    return path

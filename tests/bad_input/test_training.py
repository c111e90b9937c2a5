"""The cases that must train to show they hold (slow tier: each launches `ds-omni train`):
bad samples of every kind skipped under on_bad_sample "skip" while images of odd PIL modes
train, and a folder where a second run was started with train.overwrite_output_dir resumed
into that run, never the first one's higher steps."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.data_files import conversation_rows
from tests.e2e.launch import train
from tests.fixtures import ds_config, tiny_config_dict

pytestmark = pytest.mark.slow


def _messy_source(folder: Path) -> dict:
    """16 good rows, and: a malformed line, a row whose image is too big for
    data.max_image_pixels (64 x 64 > 32 x 32), a 16-bit PNG, an RGBA PNG, a palette PNG with a
    transparent colour."""
    folder.mkdir(parents=True)
    rows = conversation_rows(20)
    lines = []
    for row in rows:
        (folder / f"{row['id']}.png").write_bytes(row["image"]["bytes"])
        lines.append(json.dumps({**row, "image": f"{row['id']}.png"}))
    ramp = np.tile(np.arange(32), (32, 1))
    Image.fromarray((ramp * 2000).astype(np.uint16)).save(folder / "r16.png")  # I;16
    rgba = Image.fromarray((ramp * 8).astype(np.uint8)).convert("RGBA")
    rgba.putalpha(128)
    rgba.save(folder / "r17.png")
    Image.fromarray((ramp * 8).astype(np.uint8)).convert("P").save(folder / "r18.png",
                                                                   transparency=0)
    Image.new("RGB", (64, 64), (9, 99, 199)).save(folder / "r19.png")  # past the pixel limit
    lines.insert(5, lines[5][:-20])  # line 6: cut short
    (folder / "data.jsonl").write_text("\n".join(lines) + "\n")
    return {"name": "messy", "path": str(folder / "data.jsonl"), "on_bad_sample": "skip",
            "schema": {"text": "conversations", "image": "image"}}


def _write(tmp_path: Path, cfg: dict) -> tuple[str, str]:
    c, d = tmp_path / "cfg.json", tmp_path / "ds.json"
    c.write_text(json.dumps(cfg))
    d.write_text(json.dumps(ds_config(2)))
    return str(c), str(d)


@pytest.mark.timeout(600)
def test_bad_samples_are_skipped_and_odd_images_train(tmp_path):
    out = tmp_path / "run"
    cfg = tiny_config_dict(str(out), steps=3, log_samples=True)
    cfg["data"]["sources"] = [_messy_source(tmp_path / "data")]
    cfg["data"]["max_image_pixels"] = 32 * 32
    result = train("single", 1, *_write(tmp_path, cfg))
    assert result.returncode == 0, result.stdout[-3000:]
    skipped = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    reasons = {e["id"]: e["reason"] for e in skipped}  # (an epoch may come round again)
    assert sorted(reasons) == ["messy/messy:0:5", "messy/r19"], reasons
    assert any("data.jsonl' line 6 is not valid JSON" in r for r in reasons.values()), reasons
    assert any("64 x 64 = 4096 pixels, above data.max_image_pixels=1024" in r
               for r in reasons.values()), reasons
    trained = {k for r in (out / "metrics.jsonl").read_text().splitlines()
               for k in json.loads(r).get("sample_keys", [])}
    odd = {"messy:0:17", "messy:0:18", "messy:0:19"}  # r16-r18: rows after the broken line
    assert odd <= {k.split("/", 1)[1] for k in trained}, trained  # keys: "<epoch>/<locator>"


@pytest.mark.timeout(900)
def test_resume_after_overwrite_follows_the_new_run(tmp_path):
    out = tmp_path / "run"
    (tmp_path / "a").mkdir()
    first = _write(tmp_path / "a", tiny_config_dict(str(out), steps=3, save_every=1))
    assert train("single", 1, *first).returncode == 0  # run A: checkpoints 1, 2, 3
    again = train("single", 1, *first)
    assert again.returncode == 2 and "already holds the checkpoints of a run" in again.stdout
    (tmp_path / "b").mkdir()
    second = _write(tmp_path / "b", tiny_config_dict(str(out), steps=3, save_every=1,
                                                     overwrite_output_dir=True))
    assert train("single", 1, *second, "--stop-after", "1").returncode == 0  # run B: step 1
    run_b = (out / "run_id").read_text()
    resumed = train("single", 1, *second, "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"resuming run {run_b} from" in resumed.stdout and "step00000001" in resumed.stdout
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 2, steps  # B's steps only, in order

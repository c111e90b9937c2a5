"""Real runs through each launcher: they train, agree with each other, and export a usable model."""

import json
from pathlib import Path

import pytest

from ds_omni.train.metrics import read_metrics
from tests.e2e.faulty import fired_at
from tests.e2e.launch import BIN, launcher_cmd, run, train, write_configs

pytestmark = pytest.mark.e2e


def _losses(out: str) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory) -> Path:
    """2 ranks through the deepspeed launcher, exporting to HF at the end: the run the other
    launchers must reproduce, and the export under test (one launch serves both).
    (tests/dist/test_parity.py checks such runs against one process without DeepSpeed.)"""
    cfg, ds, out = write_configs(tmp_path_factory.mktemp("deepspeed"), steps=3, export_hf=True)
    res = train("deepspeed", 2, cfg, ds)
    assert res.returncode == 0, res.stdout[-3000:]
    report = json.loads((Path(out) / "report.json").read_text())
    assert report["world_size"] == 2 and report["dp"] == 2
    return Path(out)


@pytest.fixture(scope="module")
def reference(deepspeed_run):
    return read_metrics(str(deepspeed_run))


def _same_run(out: str, reference: list[dict]) -> None:
    got = read_metrics(out)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in reference], rel=1e-6)
    assert [r["sample_keys"] for r in got] == [r["sample_keys"] for r in reference]


def test_accelerate_reproduces_the_deepspeed_run(tmp_path, reference):
    cfg, ds, out = write_configs(tmp_path, steps=3)
    res = train("accelerate", 2, cfg, ds)
    assert res.returncode == 0, res.stdout[-3000:]
    _same_run(out, reference)


# torchrun's part of the kill points (the deepspeed launcher's: tests/e2e/test_resume.py and
# test_sequence_parallel_run.py): rank 1 dies (SIGKILL) inside its loader, processing the batch of
# step 2 (on the prefetch thread, while step 1 trains). Under torchrun the rendezvous store is its
# agent's, not rank 0's.
TORCHRUN_FAULTS = "kill:1:loader:2"


@pytest.mark.slow  # 80 s: the quick tier keeps the accelerate and plain-process launches
def test_torchrun_reproduces_the_deepspeed_run_across_a_killed_rank(tmp_path, reference):
    """Under `ds-omni supervise`: the kill ends the whole torchrun job within a bounded time,
    naming the dead rank; the resumed job ends as the uninterrupted deepspeed run."""
    cfg, ds, out = write_configs(tmp_path / "run", steps=3, save_every=1)
    training = launcher_cmd("torchrun", 2)[:-1] + ["tests.e2e.faulty", "train", "--config", cfg,
                                                   "--deepspeed", ds]
    res = run([str(BIN / "ds-omni"), "supervise", "--max-restarts", "1", "--backoff", "0", "--",
               *training], timeout=600,
              env={"DS_OMNI_TEST_FAULTS": TORCHRUN_FAULTS, "DS_OMNI_TEST_FAULT_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stdout[-5000:]
    [restart] = [json.loads(x) for x in (Path(out) / "restarts.jsonl").read_text().splitlines()]
    assert "rank 1 is gone" in restart["cause"] and "has exited" in restart["cause"], restart
    assert restart["time"] - fired_at(tmp_path, 1)[0] < 30, restart
    assert restart["resume_from"] == "step00000001", restart  # batch 2 is made once 1 is taken
    _same_run(out, reference)


def test_single_process_without_a_launcher_skips_bad_samples_visibly(tmp_path):
    """`ds-omni train` alone, the demo data mixed with a source holding one row of each problem
    (`tests/data_layouts.write_problem_json`) under on_bad_sample="skip": it trains, and every
    skipped sample is in skipped.jsonl, on the console and in the report, and never trained.
    A validation set is evaluated every 2 steps: in metrics.jsonl, the progress bar, the report."""
    from tests.data_layouts import write_problem_json
    from tests.fixtures import eval_sources
    problems, kinds = write_problem_json(tmp_path / "data")
    cfg, ds, out = write_configs(tmp_path, steps=3)
    config = json.loads(Path(cfg).read_text())
    config["data"]["sources"].append({"name": "problems", "path": str(problems), "weight": 1.0,
                                      "on_bad_sample": "skip",
                                      "schema": {"text": "conversations", "image": "image"}})
    config["data"]["eval_sources"] = eval_sources(tmp_path)  # and validation every 2 steps
    config["train"]["eval_every"] = 2
    Path(cfg).write_text(json.dumps(config))
    res = train("single", 1, cfg, ds)
    assert res.returncode == 0, res.stdout[-3000:]
    records = read_metrics(out)
    assert len(records) == 3 and records[-1]["loss"] < records[0]["loss"]
    assert "bad sample" in res.stdout
    assert [r["step"] for r in records if "eval_loss" in r] == [1, 2]  # after steps 2 and 3
    assert f"eval={records[-1]['eval_loss']:.4f}" in res.stdout

    skipped = [json.loads(x) for x in (Path(out) / "skipped.jsonl").read_text().splitlines()]
    assert skipped and all(e["source"] == "problems" and e["reason"] for e in skipped)
    ids = {e["id"].removeprefix("problems/") for e in skipped}  # sample ids carry their source
    assert ids <= set(kinds) and {"missing", "corrupt", "markers"} <= ids
    report = json.loads((Path(out) / "report.json").read_text())
    assert report["data_skipped"]["problems"] == len(skipped)
    assert report["last_eval_loss"] == records[-1]["eval_loss"]
    trained = {k.split("/", 1)[1] for r in records for k in r["sample_keys"]}
    assert not trained & {e["locator"] for e in skipped}


def test_export_loads_in_transformers_and_generates(deepspeed_run):
    out = deepspeed_run
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from ds_omni.data.demo import shapes_rows
    from ds_omni.model.convert import consolidate_checkpoint
    from PIL import Image
    import io
    hf_dir = Path(out) / "hf"
    model = AutoModelForImageTextToText.from_pretrained(hf_dir)
    processor = AutoProcessor.from_pretrained(hf_dir)
    # the exported weights are the trained ones, bit for bit
    trained = consolidate_checkpoint(Path(out) / "checkpoints")
    hf_state = model.state_dict()
    assert torch.equal(hf_state["lm_head.weight"], trained["backbone.lm_head.weight"])
    row = shapes_rows(1, seed=7)[0]
    image = Image.open(io.BytesIO(row["image"]["bytes"]))
    inputs = processor(images=[image], text="<s>USER: <image>\nWhat is in the picture?\nASSISTANT: ",
                       return_tensors="pt")
    # the export carries the template trained with ("plain": the demo tokenizer has none)
    chat = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image", "image": image},
                                      {"type": "text", "text": "\nWhat is in the picture?"}]}],
        add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    assert torch.equal(chat["input_ids"], inputs["input_ids"])
    generated = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 5


def test_omni_composition_trains_and_exports(tmp_path):
    """examples/tiny_omni.json: CLIP + Whisper + Qwen2 on image+audio+text data, 2 ranks, ZeRO-3."""
    from tests.e2e.launch import REPO, run, launcher_cmd
    out = tmp_path / "omni"
    res = run(launcher_cmd("deepspeed", 2) + [
        "train", "--config", str(REPO / "examples" / "tiny_omni.json"),
        "--deepspeed", str(REPO / "ds_configs" / "zero3.json"),
        "--set", "train.steps=3", "--set", "train.warmup_steps=1", "--set", f"train.output_dir={out}"])
    assert res.returncode == 0, res.stdout[-3000:]
    losses = _losses(str(out))
    assert len(losses) == 3 and all(l == l for l in losses)
    import ds_omni.model.families  # noqa: F401  (registers the composed class with transformers)
    from transformers import AutoModelForImageTextToText
    model = AutoModelForImageTextToText.from_pretrained(out / "hf")
    assert type(model).__name__ == "OmniComposedForConditionalGeneration"
    assert hasattr(model, "audio_tower") and hasattr(model, "vision_tower")

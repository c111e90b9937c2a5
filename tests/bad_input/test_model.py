"""Model folders and parts as users bring them, refused at start-up (before the process group
and the model) naming the folder or the field and the fix; nothing is written."""

import json
import shutil
from pathlib import Path

import pytest

from tests.bad_input.common import config, refused, says, snapshot, train, write
from tests.family_dirs import make_llava_dir
from tests.fixtures import TINY_LLAMA, TINY_VISION


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_llava_dir(tmp_path_factory.mktemp("llava"))


def _folder(files: dict):
    def make(d: Path, llava: Path) -> str:
        (d / "m").mkdir()
        for name, text in files.items():
            (d / "m" / name).write_text(text)
        return str(d / "m")
    return make


def _llava_without_weights(d: Path, llava: Path) -> str:
    shutil.copytree(llava, d / "m")
    for p in (d / "m").glob("*.safetensors"):
        p.unlink()
    return str(d / "m")


def _composed(**parts):
    """A tiny composition with `parts` (built from the folder maker given) replacing its own."""
    def make(d: Path, llava: Path) -> dict:
        model = {"tokenizer": "builtin:shapes", "vision": {"config": dict(TINY_VISION)},
                 "llm": {"config": dict(TINY_LLAMA)}}
        for name, part in parts.items():
            model[name] = part(d, llava) if callable(part) else part
        return model
    return make


BERT = json.dumps({"model_type": "bert"})
MODEL_CASES = {  # name: (model section, or a folder maker for model.pretrained; words)
    "pretrained_missing": (lambda d, llava: str(d / "nope"),
                           ["nope' is not an HF model directory", "no config.json",
                            "save_pretrained"]),
    "pretrained_empty": (_folder({}), ["is not an HF model directory"]),
    "config_not_json": (_folder({"config.json": "{oops"}),
                        ["config.json' is not valid JSON", "save the model again"]),
    "config_without_model_type": (_folder({"config.json": "{}"}),
                                  ["config.json' has no 'model_type'"]),
    "encoder_only_folder": (_folder({"config.json": BERT}),
                            ["model_type 'bert' has no ds_omni adapter", "compose one from parts"]),
    "no_safetensors": (_llava_without_weights,
                       ["no safetensors weights in", "safe_serialization=True"]),
    "llm_part_is_a_bert_folder": (
        _composed(llm=lambda d, llava: {"pretrained": _folder({"config.json": BERT})(d, llava)}),
        ["model.llm has model_type 'bert'", "decoder-only causal LM"]),
    "llm_part_missing": (_composed(llm={"pretrained": "/nonexistent/llm"}),
                         ["/nonexistent/llm' is not an HF model directory"]),
    "vision_part_unknown_type": (_composed(vision={"config": {"model_type": "clipp"}}),
                                 ["model.vision.config: unknown model_type 'clipp'"]),
    "neither_pretrained_nor_llm": (lambda d, llava: {"tokenizer": "builtin:shapes",
                                                     "vision": {"config": dict(TINY_VISION)}},
                                   ["set exactly one of 'pretrained'", "'llm'"]),
}


@pytest.mark.parametrize("name", sorted(MODEL_CASES))
def test_bad_model_folder_is_refused_at_start_up(tmp_path, capsys, no_training, llava_dir, name):
    make, words = MODEL_CASES[name]
    cfg = config(tmp_path / "out")
    made = make(tmp_path, llava_dir)
    cfg["model"] = made if isinstance(made, dict) else {"pretrained": made}
    says(refused(capsys, *write(tmp_path, cfg)), *words)
    assert snapshot(tmp_path / "out") == {}


def test_a_whole_model_folder_starts(tmp_path, capsys, no_training, llava_dir):
    cfg = config(tmp_path / "out")
    cfg["model"] = {"pretrained": str(llava_dir)}
    assert train(capsys, *write(tmp_path, cfg))[0] == "started"

"""The README's fine-tune config loads strictly, merges with the DeepSpeed config its launch line
names, and every field it sets is explained in the list below it."""

import json
import re
from pathlib import Path

from ds_omni.config import load_config
from ds_omni.parallel.plan import ParallelPlan
from ds_omni.train.ds_config import derive_ds_config, load_ds_json

REPO = Path(__file__).resolve().parents[3]
SECTION = REPO.joinpath("README.md").read_text().split("## Fine-tune your model", 1)[1]
SECTION = SECTION.split("\n## ", 1)[0]


def _config() -> dict:
    block = re.search(r"```json\n(.*?)```", SECTION, re.S)
    assert block, "README's 'Fine-tune your model' has no ```json block"
    return json.loads(block.group(1))


def _leaves(node, path=""):
    if isinstance(node, dict):
        return [leaf for key, value in node.items() for leaf in _leaves(value, f"{path}.{key}")]
    if isinstance(node, list) and node and isinstance(node[0], dict):
        return [leaf for item in node for leaf in _leaves(item, path)]
    return [path.lstrip(".")]


def test_readme_config_loads_and_merges(tmp_path):
    path = tmp_path / "my.json"
    path.write_text(json.dumps(_config()))
    cfg = load_config(path)
    launch = re.search(r"deepspeed --num_gpus (\d+) .*--deepspeed (\S+)", SECTION)
    world, ds_json = int(launch.group(1)), REPO / launch.group(2)
    plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
    merged = derive_ds_config(cfg, load_ds_json(ds_json), plan)
    assert merged["train_batch_size"] == cfg.train.global_batch_size
    assert "auto" not in json.dumps(merged)


def test_every_field_of_the_readme_config_is_explained():
    explained = {name.split(".")[-1] for bullet in re.findall(r"^- (.*)", SECTION, re.M)
                 for name in re.findall(r"`([\w.\[\]]+)`(?=[,:])", bullet.split(":", 1)[0] + ":")}
    explained = {name.removesuffix("[]") for name in explained}
    missing = [leaf for leaf in _leaves(_config()) if leaf.split(".")[-1] not in explained]
    assert not missing, f"README's config sets fields its list does not explain: {missing}"

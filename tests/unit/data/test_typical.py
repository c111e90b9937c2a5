"""The items a typical sample carries (`ds_omni.data.typical`): the sources' first rows counted
undecoded, weighed by the mix as it starts; a source that cannot be read counts one of each."""

import pytest

from ds_omni.config import DataConfig, SchemaConfig, SourceConfig, WeightPoint
from ds_omni.data import typical
from tests.data_files import conversation_rows, text_rows, write


def _source(tmp_path, name: str, rows: list[dict], weight: float) -> SourceConfig:
    path, schema = write("json", rows, tmp_path / name, files=1)
    return SourceConfig(name=name, path=path, weight=weight, schema=SchemaConfig(**schema))


def test_items_a_sample_follow_the_mix(tmp_path):
    images = _source(tmp_path, "img", conversation_rows(8), 9.0)
    text = _source(tmp_path, "txt", text_rows(8), 1.0)
    assert typical.source_items(images)["vision"] == pytest.approx(1.0)
    assert typical.source_items(text)["vision"] == 0.0
    cfg = DataConfig(sources=[images, text])
    assert typical.items_per_sample(cfg)["vision"] == pytest.approx(0.9)
    # the schedule's weights at step 0 replace the base weights
    cfg = DataConfig(sources=[images, text],
                     schedule=[WeightPoint(step=0, weights={"img": 1.0, "txt": 9.0})])
    assert typical.encoder_items_per_sample(cfg, ["vision"]) == {"vision": pytest.approx(0.1)}


def test_a_source_that_cannot_be_read_counts_one_item_of_each_kind(tmp_path):
    missing = SourceConfig(name="gone", path=str(tmp_path / "nowhere.jsonl"))
    assert typical.source_items(missing) == {"vision": 1.0, "audio": 1.0, "video": 1.0}

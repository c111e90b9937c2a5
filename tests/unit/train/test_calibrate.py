"""A short profile run fits the cost model's scales; the loader takes them from the config."""

import json

import pytest

from ds_omni.cli import main
from ds_omni.errors import ConfigError
from tests.fixtures import tiny_config_dict


def test_calibrate_cost_writes_scales_the_loader_accepts(tmp_path, capsys):
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(tiny_config_dict(str(tmp_path / "out"))))
    out = tmp_path / "scales.json"
    assert main(["calibrate-cost", "--config", str(cfg_path), "--batches", "4",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    scales = result["cost_scales"]
    assert set(scales) == {"llm_quad", "llm_lin", "vision_quad", "vision_lin"}
    assert all(v >= 0 for v in scales.values()) and any(v > 0 for v in scales.values())
    assert result["micro_batches"] == 4
    # seconds, not FLOPs: a tiny model's micro-batch takes milliseconds
    from ds_omni.config import OmniConfig, from_dict
    from ds_omni.data.build import cost_model_for
    from ds_omni.model.build import build_model
    d = tiny_config_dict(str(tmp_path / "out"))
    d["data"]["reorder"] = {"cost_scales": scales}
    cfg = from_dict(OmniConfig, d)
    model = cost_model_for(build_model(cfg.model), [], cfg.data.reorder.cost_scales)
    assert model.scales == scales
    with pytest.raises(ConfigError, match="unknown cost term"):
        cost_model_for(build_model(cfg.model), [], {"audio_quad": 1.0})

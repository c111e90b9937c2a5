"""`encoder_placement: "auto"` beside sp and tp under pp: the cost model prices one pipeline's
typical step (a rank's share of each stage; an SP shard's half of a row's items, every item on
each TP rank), and the training path (`pipeline_spec_for`, what `parallelize` builds the stages
from) takes the placement it resolves. Pure: no process group."""

import pytest
import torch

from tests import plants
from tests.fixtures import tiny_config_dict


def _spec(parallel: dict, world: int):
    from ds_omni.config import OmniConfig, from_dict
    from ds_omni.model.build import build_model
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.parallelize.pipeline import pipeline_spec_for, stage_plan, typical_step
    from ds_omni.train.setup import cost_model
    d = tiny_config_dict("/nonexistent")
    d["parallel"] = {"pp": 2, "encoder_placement": "auto", **parallel}
    cfg = from_dict(OmniConfig, d)
    plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
    with torch.device("meta"):
        built = build_model(cfg.model)
    cost = cost_model(cfg, built)
    typical = typical_step(cfg, plan, cost, stage_plan(cfg, built, plan, cost))
    return pipeline_spec_for(cfg, built, plan, cost, None), typical


def check_auto_prices_a_pipeline() -> None:
    """Short stages (8 tokens) on this machine's calibrated call and message costs: an SP shard
    encodes half the row's items (4 a step) on half-size stages, and its
    model's step under "bubbles" is faster (they fit stage 0's idle slots, no message); a TP
    rank has the same half-size stages but encodes every item, which fit nowhere: "uniform"."""
    sp, sp_typical = _spec({"sp": 2, "stage_tokens": 8}, 4)
    tp, tp_typical = _spec({"tp": 2, "stage_tokens": 8}, 4)
    assert sp.placement == "bubbles" and tp.placement == "uniform"
    assert sp_typical[0] == tp_typical[0] == [t / 2 for t in sp.stage_plan.layer_time]
    assert sp_typical[3] == {"vision": 0.5} and tp_typical[3] == {"vision": 1.0}


def test_auto_prices_a_pipeline_beside_sp_and_tp():
    check_auto_prices_a_pipeline()


@pytest.mark.parametrize("plant", plants.for_launch("auto_composed"))
def test_plant_auto_composed(plant):
    with plants.applied(plant, 0):
        with pytest.raises(AssertionError):
            check_auto_prices_a_pipeline()

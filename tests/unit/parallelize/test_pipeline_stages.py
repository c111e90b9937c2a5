"""Pipeline stage boundaries from the cost model, and bad pipeline input (pure: no process group)."""

import itertools
import json

import numpy as np
import pytest

from ds_omni.cli import main
from ds_omni.parallel.stages import (describe, even_layer_parts, parameter_parts, partition,
                                     plan_stages, step_stage_times)
from tests.fixtures import ds_config, tiny_config_dict


def _largest(costs, parts):
    return max(sum(costs[a:b]) for a, b in zip(parts[:-1], parts[1:]))


@pytest.mark.parametrize("seed", range(6))
def test_partition_is_the_best_contiguous_split(seed):
    rng = np.random.default_rng(seed)
    costs = list(rng.uniform(0.1, 5.0, size=int(rng.integers(3, 9))))
    stages = int(rng.integers(1, len(costs) + 1))
    parts = partition(costs, stages)
    assert parts[0] == 0 and parts[-1] == len(costs) and len(parts) == stages + 1
    assert all(a < b for a, b in zip(parts[:-1], parts[1:]))  # no empty stage
    brute = min(_largest(costs, [0, *cut, len(costs)])
                for cut in itertools.combinations(range(1, len(costs)), stages - 1))
    assert _largest(costs, parts) == pytest.approx(brute)


def test_stage0_moves_decoder_layers_off_the_encoding_stage():
    # 8 equal decoder layers (cost 1), light head, encoder work worth 4 layers
    plan = plan_stages(1.0, 8, 0.5, 4.0, stages=2, placement="stage0")
    assert plan.parts == [0, 3, 10]  # stage 0: embedding + 2 decoders + encoders = 6; stage 1: 6.5
    assert plan.stage_time == pytest.approx([6.0, 6.5])
    assert list(plan.decoder_layers(0)) == [0, 1] and list(plan.decoder_layers(1)) == list(range(2, 8))
    # without encoder work the split is even in layers
    assert plan_stages(1.0, 8, 0.0, 0.0, 2, "stage0").parts == [0, 5, 10]


def test_uniform_shares_encoder_work_and_beats_stage0_when_the_mix_swings():
    uniform = plan_stages(1.0, 8, 0.5, 4.0, stages=2, placement="uniform")
    assert uniform.encoder_time == pytest.approx([2.0, 2.0])
    assert uniform.parts == [0, 5, 10]  # layers alone decide the split
    assert uniform.stage_time == pytest.approx([4.0 + 2.0, 4.5 + 2.0])
    stage0 = plan_stages(1.0, 8, 0.5, 4.0, 2, "stage0")
    # on the mix they were planned for, both balance (stage 0 gives up decoder layers) ...
    assert max(uniform.stage_time) == max(stage0.stage_time) == 6.5
    # ... but the boundaries stay while the mix swings: 3x the images, then none
    assert max(step_stage_times(stage0, 12.0, "stage0")) == 14.0
    assert max(step_stage_times(uniform, 12.0, "uniform")) == 10.5
    assert max(step_stage_times(stage0, 0.0, "stage0")) == 6.5
    assert max(step_stage_times(uniform, 0.0, "uniform")) == 4.5
    rows = describe(uniform)
    assert [r["decoder_layers"] for r in rows] == ["0-3", "4-7"]
    assert sum(r["encoder_share"] for r in rows) == pytest.approx(1.0)
    assert max(r["relative_time"] for r in rows) == 1.0


def test_megatron_split_is_even_in_decoder_layers_whatever_stage_0_encodes():
    assert even_layer_parts(4, 2) == [0, 3, 6]  # embedding + 2 | 2 + head
    assert even_layer_parts(5, 2) == [0, 3, 7]  # the later stage takes the odd layer
    assert even_layer_parts(7, 3) == [0, 3, 5, 9]  # 2 | 2 | 3
    assert even_layer_parts(4, 4) == [0, 2, 3, 4, 6]
    # 8 decoders, encoder work worth 4 of them: the cost split keeps 2 on stage 0, Megatron 4
    plan = plan_stages(1.0, 8, 0.5, 4.0, 2, "stage0", split="layers")
    assert plan.parts == [0, 5, 10] and plan.split == "layers"
    assert plan.stage_time == pytest.approx([8.0, 4.5])  # against the cost split's [6.0, 6.5]
    assert plan.encoder_time == [4.0, 0.0]


def test_deepspeed_split_balances_trainable_parameters_with_the_encoders_on_stage_0():
    params = [100] + [10] * 8 + [100]  # [embedding, 8 decoders, head]
    plan = plan_stages(1.0, 8, 0.5, 4.0, 2, "stage0", split="parameters", layer_params=params,
                       encoder_params=50)
    assert plan.parts == [0, 3, 10]  # 100 + 50 + 2 x 10 = 170 | 6 x 10 + 100 = 160
    assert plan.stage_time == pytest.approx([6.0, 6.5])
    # a tower of 200: every decoder layer it can give up leaves stage 0 (300 | 180)
    assert plan_stages(1.0, 8, 0.5, 4.0, 2, "stage0", split="parameters", layer_params=params,
                       encoder_params=200).parts == [0, 1, 10]
    # "uniform": every stage holds a replica, no pipeline layer: the tower counts nowhere
    uniform = plan_stages(1.0, 8, 0.5, 4.0, 2, "uniform", split="parameters",
                          layer_params=params, encoder_params=200)
    assert uniform.parts == [0, 5, 10] and uniform.encoder_time == pytest.approx([2.0, 2.0])
    # DeepSpeed minimises the spread, largest minus smallest stage, not the largest stage:
    # 9 | 3 | 3 where the smallest largest stage is 1 | 8 | 6
    assert parameter_parts([1, 8, 3, 3], 3) == [0, 2, 3, 4]
    assert partition([1, 8, 3, 3], 3) == [0, 1, 2, 4]
    with pytest.raises(ValueError, match="trainable parameter count of each of the 10"):
        plan_stages(1.0, 8, 0.5, 4.0, 2, "stage0", split="parameters", layer_params=params[:-1])


def test_parameter_split_is_deepspeeds_partition_balanced():
    """The port gives DeepSpeed's own boundaries, ties included (small integer weights make many)."""
    from deepspeed.runtime.utils import partition_balanced
    rng = np.random.default_rng(0)
    for _ in range(60):
        weights = [int(w) for w in rng.integers(0, 6, size=int(rng.integers(3, 12)))]
        stages = int(rng.integers(1, len(weights)))
        want = [int(p) for p in partition_balanced(weights=weights, num_parts=stages)]
        assert parameter_parts(weights, stages) == want, (weights, stages)


def test_layer_parameter_counts_leave_frozen_parts_out(tmp_path):
    from ds_omni.model.build import build_model
    from ds_omni.parallelize.pipeline import layer_param_counts
    from tests.fixtures import tiny_config
    cfg = tiny_config(str(tmp_path / "run"))
    model = build_model(cfg.model).model
    layers, encoders = layer_param_counts(model)
    assert len(layers) == len(model.backbone.layers) + 2
    assert sum(layers) + encoders == sum(p.numel() for p in model.parameters())
    assert encoders == sum(p.numel() for p in model.encoders.parameters()) > 0
    assert layers[0] == model.backbone.embed_tokens.weight.numel()
    model.freeze(["vision", "projector"])
    assert layer_param_counts(model) == (layers, 0)


def _plan(tmp_path, capsys, parallel: dict, zero: int = 1, world: int = 2,
          tied: bool = False) -> tuple[int, str]:
    cfg = tiny_config_dict(str(tmp_path / "out"))
    cfg["parallel"] = parallel
    cfg["model"]["llm"]["config"]["tie_word_embeddings"] = tied
    c, d = tmp_path / "cfg.json", tmp_path / "ds.json"
    c.write_text(json.dumps(cfg))
    d.write_text(json.dumps(ds_config(zero)))
    code = main(["plan", "--config", str(c), "--deepspeed", str(d), "--world-size", str(world)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("parallel,zero,world,tied,match", [
    ({"pp": 2}, 2, 2, False, "ZeRO 0 or 1 only"),
    ({"pp": 3}, 1, 3, False, "only 2 decoder layers"),
    ({"pp": 2, "dp": 2}, 1, 2, False, "needs parallel.dp x sp x pp = 2 x 1 x 2 = 4 processes but 2"),
    ({"pp": 2, "max_sequence_sp": 2}, 1, 4, False, "per-sequence SP adds a varying number"),
    ({"pp": 2}, 1, 2, True, "ties its LM head to its token embedding"),
    ({"pp": 2, "stage_split": "megatron"}, 1, 2, False,
     "parallel.stage_split must be one of ['cost', 'parameters', 'layers']"),
])
def test_bad_pipeline_plans_fail_before_launch(tmp_path, capsys, parallel, zero, world, tied,
                                               match):
    code, out = _plan(tmp_path, capsys, parallel, zero, world, tied)
    assert code == 2 and match in out and "Traceback" not in out, out


def test_plan_prints_stages_and_their_predicted_time(tmp_path, capsys, monkeypatch):
    """Planned for samples of parallel.stage_tokens (8) tokens, not max_seq_len (128): so short a
    sample weighs the LLM little against the encoders, and stage 0 (all the encoding, under
    "stage0") is the slower stage; planned for 128 tokens, stage 1 (head) is. Planning imports
    no DeepSpeed: its first import prints a warning to stdout, before the plan's JSON."""
    import sys
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        monkeypatch.setitem(sys.modules, name, None)  # an import of it now fails
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    code, out = _plan(tmp_path, capsys, {"pp": 2, "stage_tokens": 8})
    assert code in (0, None), out
    pipeline = json.loads(out)["pipeline"]
    stages = pipeline["stages"]
    assert [s["stage"] for s in stages] == [0, 1] and stages[0]["embedding"] and stages[1]["head"]
    assert stages[0]["encoder_share"] == 1.0 and all(s["predicted_gflop"] > 0 for s in stages)
    assert "2 samples x 8 tokens" in pipeline["workload"]
    assert [s["relative_time"] for s in stages] == [1.0, pytest.approx(0.83, abs=0.05)]
    # the split used, and the slowest stage under each split (tiny LLaVA's 2 layers: all alike)
    assert pipeline["stage_split"] == "cost"
    assert pipeline["slowest_stage_by_split"] == {"cost": 1.0, "parameters": 1.0, "layers": 1.0}


def test_plan_prints_the_typical_step_auto_decides_by(tmp_path, capsys):
    """Under "auto" `ds-omni plan` prints the typical step's plan: the demo data (one image a
    sample) gives the step's 8 images, and the placement is what that plan's gain says."""
    from ds_omni.parallel.bubbles import picks_bubbles
    code, out = _plan(tmp_path, capsys, {"pp": 2, "encoder_placement": "auto"})
    assert code in (0, None), out
    pipeline = json.loads(out[out.index("{"):])["pipeline"]
    typical = pipeline["bubble_schedule"]
    assert typical["items_per_step"] == {"vision": 8}
    assert pipeline["encoder_placement"] == ("bubbles" if picks_bubbles(typical) else "uniform")


@pytest.mark.parametrize("zero", [2, 3])
def test_train_refuses_pipeline_with_zero2_before_any_process_group(tmp_path, capsys, monkeypatch,
                                                                    zero):
    """DeepSpeed's pipeline engine runs ZeRO 0/1 only: ds_omni says so in its preflight, before
    the process group, the model or DeepSpeed (the slow tier's pipeline cases run ZeRO 0 and 1)."""
    from ds_omni.train import loop
    cfg = tiny_config_dict(str(tmp_path / "out"))
    cfg["parallel"] = {"pp": 2}
    c, d = tmp_path / "cfg.json", tmp_path / "ds.json"
    c.write_text(json.dumps(cfg))
    d.write_text(json.dumps(ds_config(zero)))
    monkeypatch.setenv("WORLD_SIZE", "2")  # no rendezvous exists: a collective would fail, not pass
    monkeypatch.setattr(loop, "setup_training", None)  # never reached
    monkeypatch.setattr(loop.dist, "init_distributed", None)
    assert main(["train", "--config", str(c), "--deepspeed", str(d)]) == 2
    err = capsys.readouterr().err
    assert f"parallel.pp=2 cannot be combined with zero_optimization.stage={zero}" in err and "ZeRO 0 or 1 only" in err, err
    assert "Traceback" not in err


def test_joint_plan_balances_items_and_finds_every_row():
    from types import SimpleNamespace
    from ds_omni.parallelize.joint import assign_items, plan_joint
    assert assign_items([5.0, 1.0, 4.0, 2.0, 2.0], 2) == [0, 1, 1, 1, 0]  # 7 and 7
    # 3 micro-batches: 2 images + 1 clip, nothing, 1 image (rows: embeddings per item)
    item = lambda rows: SimpleNamespace(num_embeddings=rows)  # noqa: E731
    micro = [{"vision": [item(4), item(2)], "audio": [item(3)]}, {}, {"vision": [item(1)]}]
    plan = plan_joint(micro, lambda enc, it: float(it.num_embeddings), stages=2)
    assert plan.stage_of == [0, 1, 1, 0]  # costs 4 + 1 | 2 + 3
    assert plan.rows_per_stage == [5, 5]
    index = plan.row_index()
    # stage-major rows: stage 0 has items 0, 3 (rows 0-3, 4); stage 1 items 1, 2 (rows 5-6, 7-9)
    assert index == {(0, "vision"): [0, 1, 2, 3, 5, 6], (0, "audio"): [7, 8, 9], (2, "vision"): [4]}
    assert sorted(r for rows in index.values() for r in rows) == list(range(10))


def test_a_pipeline_checkpoint_with_a_layer_file_missing_says_so(tmp_path):
    """Export reads DeepSpeed's per-layer files into the pipeline layers' modules (the dist parity
    launch checks a real one); an incomplete or foreign checkpoint is a clear error, not a
    KeyError from inside torch."""
    import torch
    from ds_omni.errors import ModelError
    from ds_omni.model.build import build_model
    from ds_omni.model.layer_files import layer_file, load_layer_files
    from ds_omni.parallelize.pipeline import StepInputs, pipeline_layers
    from tests.fixtures import tiny_config
    cfg = tiny_config(str(tmp_path / "run"))
    trained, fresh = build_model(cfg.model).model, build_model(cfg.model).model
    with torch.no_grad():  # weights no fresh build has
        for p in trained.parameters():
            p.add_(1.0)
    layers = pipeline_layers(trained, StepInputs())
    for i, layer in enumerate(layers):  # what PipelineModule.save_state_dict writes
        torch.save(layer.state_dict(), layer_file(tmp_path, i))
    load_layer_files(fresh, tmp_path)
    assert all(torch.equal(p, q) for p, q in zip(trained.state_dict().values(),
                                                  fresh.state_dict().values()))
    layer_file(tmp_path, len(layers) - 1).unlink()
    with pytest.raises(ModelError, match=f"holds {len(layers) - 1} pipeline layer files but "
                                         f"this model has {len(layers)}"):
        load_layer_files(fresh, tmp_path)


def _qwen3_vl_pp2_tp2(tmp_path, monkeypatch) -> list[str]:
    """The CLI's arguments to train the tiny Qwen3-VL under pp2 x tp2 on 4 ranks, with no
    rendezvous (a collective would fail) and no set-up (never to be reached)."""
    from tests import family_dirs
    from ds_omni.train import loop
    cfg = tiny_config_dict(str(tmp_path / "out"))
    cfg["model"] = {"pretrained": str(family_dirs.make_generic_dir(tmp_path / "q3", "qwen3_vl"))}
    cfg["parallel"] = {"pp": 2, "tp": 2, "stage_split": "layers"}
    c, d = tmp_path / "cfg.json", tmp_path / "ds.json"
    c.write_text(json.dumps(cfg))
    d.write_text(json.dumps(ds_config(1)))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(loop, "setup_training", None)
    return ["train", "--config", str(c), "--deepspeed", str(d)]


def test_train_takes_qwen3_vl_under_pp_and_tp(tmp_path, capsys, monkeypatch):
    """Deepstack (Qwen3-VL) under pp x tp: HF's Qwen3-VL text plan names its embedding alone;
    ds_omni borrows Qwen3's (`tensor_parallel.PLAN_OF`), so the preflight passes and the run
    goes on to the process group (training it: tests/dist/test_pipeline_deepstack.py)."""
    from ds_omni.train import loop
    args = _qwen3_vl_pp2_tp2(tmp_path, monkeypatch)
    reached = []

    def init_distributed(timeout_s):
        reached.append(timeout_s)
        raise RuntimeError("the process group: past the preflight")
    monkeypatch.setattr(loop.dist, "init_distributed", init_distributed)
    with pytest.raises(RuntimeError, match="past the preflight"):
        main(args)
    assert len(reached) == 1
    assert "tensor-parallel plan" not in capsys.readouterr().err


def test_train_refuses_an_unsplittable_llm_under_pp_and_tp_before_any_process_group(
        tmp_path, capsys, monkeypatch):
    """The same run with Qwen3-VL's own HF text plan (a stand-in for a family AutoTP cannot
    split: it names the embedding alone): refused in the preflight, before the process group,
    the model or DeepSpeed, saying why and what spreads the parameters instead."""
    from ds_omni.parallelize import tensor_parallel
    from ds_omni.train import loop
    args = _qwen3_vl_pp2_tp2(tmp_path, monkeypatch)
    monkeypatch.setattr(tensor_parallel, "PLAN_OF", {})
    monkeypatch.setattr(loop.dist, "init_distributed", None)  # never reached
    assert main(args) == 2
    err = capsys.readouterr().err
    assert ("parallel.tp=2: the HuggingFace tensor-parallel plan of the LLM of" in err
            and "(qwen3_vl_text) splits no column- and row-parallel projection pair "
            "(['embed_tokens']), so DeepSpeed's AutoTP would leave its layers whole; set "
            "parallel.tp to 1 (parallel.pp or ZeRO-3 spread its parameters instead)" in err), err
    assert "Traceback" not in err

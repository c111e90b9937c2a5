"""The LLM backbone tensor-parallel (parallel.tp, DeepSpeed's AutoTP layers) equals one process.

Two ranks (tp=2, so dp=1: both ranks read the same rows) train 3 optimizer steps through
DeepSpeed under ZeRO 1 and 2 with grouped reordering on, and each case is compared with the
oracle (`tests/oracle.py`: one process, plain PyTorch, the same global batches made there): the
losses (rel 1e-6), the full reduced gradients of every step (the ranks' shards gathered whole,
`ds_omni.parallelize.tensor_parallel.gather_tp`), and the parameters after the last step.

Cases: the tiny LLaVA (Llama: 4 query / 2 key-value heads, no biases) and Qwen2-VL (3-D M-RoPE
positions, q/k/v biases sharded with their rows, a text-only source mixed in); and LLaVA with a
Qwen2 LLM of ONE key-value head (fewer than tp: DeepSpeed gives rank 0 the whole attention and
rank 1 a zero-width share, see the module docstring of `tensor_parallel`). Packed rows
(cu_seqlens) throughout. The mechanism is shown to run: the backbone's 14 projections are
AutoTP's layers, each rank holds half of the MLP, and the encoders are whole.

`test_plant_is_caught`: the oracle fails on each planted error of this launch
(`tests/plants.py`: a column shard's bias added twice; the column-parallel input gradient not
summed over the TP ranks, which leaves the loss alone and moves only the gradients of what is
below: norms, embedding, projector, vision tower).
"""

import pytest

from tests import oracle, plants
from tests.fixtures import ds_config, text_source, tiny_config
from tests.harness import run_on_ranks

STEPS = 3
ONE_KV = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
          "max_position_embeddings": 256, "tie_word_embeddings": False}


def _config(case: dict, out_dir: str):
    from ds_omni.config import ParallelConfig, SourceConfig, from_dict
    cfg = tiny_config(out_dir, steps=case.get("steps", STEPS), weight_decay=0.1)
    cfg.parallel = ParallelConfig(tp=2)
    if case.get("model_dir"):
        cfg.model.pretrained, cfg.model.tokenizer = case["model_dir"], None
        cfg.model.vision = cfg.model.llm = None
    if case.get("llm"):
        cfg.model.llm.config = dict(case["llm"])
    if case.get("sources"):
        cfg.data.sources = [from_dict(SourceConfig, s) for s in case["sources"]]
    return cfg


def _train_ranks(rank, world, cases, out_dir):
    results = {}
    for name, case in cases.items():
        for stage in case["stages"]:
            cfg = _config(case, f"{out_dir}/{name}{stage}")
            results[(name, stage)] = oracle.train_on_rank(
                rank, world, cfg, ds_config(stage), case.get("steps", STEPS), case.get("plant"))
    return results


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    from tests import family_dirs
    tmp = tmp_path_factory.mktemp("tp")
    shapes = {"name": "shapes", "path": "builtin:shapes"}
    honest = {
        "llava": {"stages": [1, 2]},
        "qwen2_vl": {"stages": [2], "model_dir": str(family_dirs.make_qwen2_vl_dir(tmp / "q")),
                     "sources": [shapes, text_source(tmp)]},
        "one_kv_head": {"stages": [1], "llm": ONE_KV},
    }
    planted = {p: {**honest["qwen2_vl"], "stages": [2], "steps": 1, "plant": p}
               for p in plants.for_launch("tp")}
    return {**honest, **planted}


@pytest.fixture(scope="module")
def tp_results(cases, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_runs")
    return run_on_ranks(_train_ranks, 2, args=(cases, str(out)), timeout=900)


def _check(name, case, results, tmp_path):
    from ds_omni.model.build import build_model
    steps = case.get("steps", STEPS)
    cfg = _config(case, str(tmp_path / f"ref_{name}"))
    step_keys = oracle.reference_step_keys(cfg, build_model(cfg.model), 1, steps)
    ref = oracle.run_reference(cfg, step_keys)
    for stage in case["stages"]:
        got = results[0][(name, stage)]
        for r in results:  # both TP ranks read the same rows: dp = 1
            assert [sorted(k) for k in r[(name, stage)]["keys"]] == step_keys, (name, stage)
        oracle.assert_matches(ref, got, f"{name} tp=2 ZeRO-{stage}")
        assert all(r[(name, stage)]["losses"] == got["losses"] for r in results), (name, stage)
    oracle.assert_moved(ref, name)
    return ref


@pytest.mark.dist
def test_tensor_parallel_matches_single_process(cases, tp_results, tmp_path):
    for name, case in cases.items():
        if "plant" not in case:
            _check(name, case, tp_results, tmp_path)


@pytest.mark.dist
def test_backbone_layers_are_autotp_shards(cases, tp_results):
    """The mechanism ran: 2 layers x (q, k, v, gate, up) column-parallel and x (o, down)
    row-parallel; each rank holds half of every MLP projection; no encoder is split."""
    for name in ("llava", "qwen2_vl"):
        for r in tp_results:
            got = r[(name, 2)]
            assert got["tp_counts"] == {"column": 10, "row": 4}, (name, got["tp_counts"])
            shapes = got["local_shapes"]
            gate = [s for n, s in shapes.items() if n.endswith("layers.0.mlp.gate_proj.weight")]
            down = [s for n, s in shapes.items() if n.endswith("layers.0.mlp.down_proj.weight")]
            assert gate == [(64, 64)] and down == [(64, 64)], (name, gate, down)  # of 128
    whole = {n: s for n, s in tp_results[0][("llava", 2)]["local_shapes"].items()
             if "backbone" not in n}
    assert whole == {n: s for n, s in tp_results[1][("llava", 2)]["local_shapes"].items()
                     if "backbone" not in n}
    # one KV head, tp=2: rank 0 holds the whole attention, rank 1 a zero-width share
    q = [{n: s for n, s in r[("one_kv_head", 1)]["local_shapes"].items()
          if n == "backbone.layers.0.self_attn.q_proj.weight"} for r in tp_results]
    assert [list(d.values()) for d in q] == [[(64, 64)], [(0, 64)]], q


@pytest.mark.dist
@pytest.mark.parametrize("plant", plants.for_launch("tp"))
def test_plant_is_caught(plant, cases, tp_results, tmp_path):
    with pytest.raises(AssertionError):
        _check(plant, cases[plant], tp_results, tmp_path)

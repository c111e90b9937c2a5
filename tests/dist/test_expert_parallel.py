"""Expert parallelism (parallel.ep, DeepSpeed's AutoEP) equals one process, exactly.

The LLM is an MoE model (Qwen3-MoE: 4 experts, top-2, HF's auxiliary load-balancing loss on)
behind a CLIP tower (the demo composition). Each case trains 3 optimizer steps on 2 ranks (ep=2:
each rank holds 2 of the 4 experts of every layer) or 4 ranks (ep=2 x dp=2: two expert-parallel
groups, each expert on two ranks), with reordering on; Qwen3-VL-MoE (the generic adapter: its
M-RoPE, deepstack and always-renormalising router) on 2 ranks; Qwen3.5-MoE's block (a shared
expert behind a sigmoid gate next to the routed ones) on 2 ranks. All are in the slow tier (the
2-rank launch alone takes about 3 min on 2 quiet cores; the quick tier's pairwise launch,
`test_pairs_quick.py`, trains ep2 x tp2 and pp2 x ep2 one step each). Each is compared
with the oracle
(`tests/oracle/`): one process, plain PyTorch, HF's MoE block (no AutoEP), the same global
batches. Loss (rel 1e-6), the full reduced gradients of every step and the parameters after the
last step must agree; AutoEP's expert shards are gathered over the expert-parallel group and
written back in HF's layout (`hf_expert_state`) for that. A counter shows AutoEP ran: every MoE
block is AutoEP's, and its tokens-per-expert counters saw every routed token.

Composed, 4 ranks each (slow tier): ep2 x tp2 (dp2; the attention over TP by AutoTP's layers, the
experts folded over the TP group: `ds_omni.parallelize.expert_folding`), checked also for AutoTP's
6 column and 2 row layers and each TP pair splitting its rows' token-expert assignments; and
pp2 x ep2 (dp2; each stage's experts over its two ranks, the aux statistics carried along the
stages: `ds_omni.parallelize.pipeline_moe`), checked also for every stage adding each of its MoE
layers' statistics for every micro-batch; pp2 x sp2 x ep2 (each stage's SP pair its EP group, the
last stage summing the carried statistics over it); ep2 x tp2 under ZeRO-3; Qwen3-VL-MoE at
ep2 x tp2 (its q/k norms, whole and missing from HF's plan, summed over TP by the plan ds_omni
borrows from Qwen3-MoE: without them its second step's loss is off by 3e-6 relative).

`test_plant_is_caught`: the checks fail when an expert's tokens are sent to the wrong rank, and
when the auxiliary loss is dropped (`tests/plants/expert_parallel.py`), one step each;
`test_plant_pp_ep_is_caught`: under pp2 x ep2, when a stage's EP ranks hold each other's experts
and when the first stage's layers are left out of the aux loss; `test_plant_ep_tp_is_caught`:
under ep2 x tp2, when the experts' gradients are not divided by tp or the router's not averaged
over TP; `test_plant_pp_sp_ep_is_caught`: under pp2 x sp2 x ep2, when the last stage skips that
SP sum.
"""

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests import oracle, plants
from tests.fixtures import ds_config, tiny_config
from tests.harness import run_on_ranks
from tests.oracle import ranks as oracle_ranks

# a launch's ranks run inside the test that first needs them: more than the suite's 600 s on a
# slow or loaded machine (their own run_on_ranks timeouts bound each launch)
pytestmark = pytest.mark.timeout(1500)

STEPS = 3
MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
       "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
       "max_position_embeddings": 256, "tie_word_embeddings": False,
       "output_router_logits": True, "router_aux_loss_coef": 0.02}
# launch -> (world, ZeRO stages, the plants' launch name or None)
LAUNCHES = {"ep2": (2, [1], "ep"), "ep2_zero2": (2, [2], None), "ep2_dp2": (4, [1, 2], None),
            "ep2_qwen3_vl_moe": (2, [2], None), "ep2_zero3": (2, [3], None),
            "ep2_shared_experts": (2, [2], None), "ep2_tp2": (4, [1], "ep_tp"),
            "ep2_tp2_zero3": (4, [3], None), "ep2_tp2_qwen3_vl_moe": (4, [1], None),
            "pp2_ep2": (4, [1], "ep_pp"), "pp2_sp2_ep2": (4, [1], "ep_pp_sp"),
            "pp2_ep2_qwen3_vl_moe": (4, [1], None)}
# Qwen3.5-MoE's block: the routed experts and a shared expert behind a sigmoid gate, which
# AutoEP keeps whole (as `shared_experts` / `shared_experts_gate`, HF's names in the oracle)
SHARED_MOE = {**MOE, "model_type": "qwen3_5_moe_text", "shared_expert_intermediate_size": 32,
              "layer_types": ["full_attention", "full_attention"]}
LLMS = {"ep2_shared_experts": SHARED_MOE}  # a launch's LLM other than MOE
# a launch's parallel degrees besides ep=2: ep2 x tp2 (dp2) folds the experts over the TP group
# (`ds_omni.parallelize.expert_folding`): EP groups [0, 1], [2, 3], the attention over TP
# pp2 x ep2 (dp2): stage 0 on ranks 0, 1 and stage 1 on 2, 3, each stage's experts over its two
# ranks, the aux statistics carried from stage to stage (`ds_omni.parallelize.pipeline_moe`)
# pp2 x sp2 x ep2 (dp1): each stage's two ranks are its SP group and its EP group; the last
# stage sums the carried aux statistics over its SP group; Qwen3-VL-MoE under pp2 x ep2: its
# deepstack levels carried beside them to stage 1 (one decoder layer a stage: "layers")
DEGREES = {"ep2_tp2": {"tp": 2}, "ep2_tp2_zero3": {"tp": 2}, "ep2_tp2_qwen3_vl_moe": {"tp": 2},
           "pp2_ep2": {"pp": 2},
           "pp2_sp2_ep2": {"pp": 2, "sp": 2},
           "pp2_ep2_qwen3_vl_moe": {"pp": 2, "stage_split": "layers"}}
RESUMED = "ep2_zero2"  # saves before its last step, resumes, reruns it; its checkpoint exported
PLANTED = {"ep_wrong_rank": "losses", "aux_loss_dropped": "losses",
           "pp_ep_wrong_group_rank": "losses", "pp_stage_aux_dropped": "losses",
           "pp_carry_backward_dropped": "grad of", "ep_tp_experts_not_divided": "grad of",
           "ep_tp_router_not_averaged": "grad of", "pp_sp_aux_not_summed": "losses"}


def make_config(out_dir: str, ep: int, model_dir: str | None = None, llm: dict | None = None,
                degrees: dict | None = None):
    """The demo composition with MOE (or `llm`) as its LLM, or the HF directory `model_dir`;
    `degrees`: other parallel degrees (e.g. {"tp": 2})."""
    from ds_omni.config import ModelConfig
    cfg = tiny_config(out_dir, steps=STEPS, weight_decay=0.1)
    cfg.model.llm.config = dict(llm or MOE)
    if model_dir is not None:
        cfg.model = ModelConfig(pretrained=model_dir)
    cfg.parallel.ep = ep
    for key, value in (degrees or {}).items():
        setattr(cfg.parallel, key, value)
    return cfg


def qwen3_vl_moe_dir(out: Path) -> str:
    """Qwen3-VL-MoE (the generic adapter: deepstack, M-RoPE; 4 experts, top-2, HF's router
    always renormalising), with HF's aux loss turned on in its text config."""
    from tests import family_dirs
    family_dirs.make_generic_dir(out, "qwen3_vl_moe")
    config = json.loads((out / "config.json").read_text())
    config["text_config"].update(output_router_logits=True, router_aux_loss_coef=0.02)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@contextmanager
def hf_layout(seen: dict):
    """The oracle's reads of parameters and gradients, with AutoEP's expert shards gathered over
    the expert-parallel group into HF's layout; `seen` counts AutoEP's layers and routed tokens."""
    import torch.distributed as tdist
    from deepspeed.utils import groups
    from ds_omni.parallelize.expert_folding import fold_counts
    from ds_omni.parallelize.expert_parallel import autoep_layers, expert_load, hf_expert_state
    reads = oracle_ranks.full_params, oracle_ranks.full_grads, oracle_ranks.omni_names

    def gathered(engine, named):
        layers = autoep_layers(engine.module)
        carry = getattr(getattr(engine.module, "step_inputs", None), "aux_carry", None)
        seen.update(autoep_layers=len(layers), micro=engine.gradient_accumulation_steps(),
                    aux_layers_added=carry.layers_added if carry is not None else None,
                    aux_sp_sums=carry.sp_sums if carry is not None else None)
        seen["fold"] = fold_counts(engine.module)
        routed = sum(float(m.tokens_per_expert.sum()) for m in layers.values())
        seen["routed"] = max(seen.get("routed", 0), routed)
        seen["routed_total"] = seen.get("routed_total", 0) + routed
        # the loop's moe_* metrics over the same counts (reduced: every rank alike; resets them)
        load = expert_load(engine.module)
        seen.setdefault("loads", []).append(load)
        seen["load_sum"] = seen.get("load_sum", 0) + sum(
            v for k, v in load.items() if k.startswith("moe_tokens_expert"))
        if not layers:  # a pipeline stage without an MoE layer
            return named
        ep = next(iter(layers.values())).ep_size
        group = groups._get_expert_parallel_group(f"ep_size_{ep}")

        def gather(t):
            parts = [torch.empty_like(t) for _ in range(ep)]
            tdist.all_gather(parts, t.contiguous(), group=group)
            return parts
        return hf_expert_state(named, ep, gather)
    # replaced where `train_on_rank` reads them (tests/oracle/__init__.py only re-exports them)
    oracle_ranks.full_params = lambda engine: gathered(engine, reads[0](engine))
    oracle_ranks.full_grads = lambda engine: gathered(engine, reads[1](engine))
    oracle_ranks.omni_names = lambda engine, built: _Same(
        {_hf_key(k): _hf_key(v) for k, v in reads[2](engine, built).items() if _hf_key(k)})
    try:
        yield
    finally:
        oracle_ranks.full_params, oracle_ranks.full_grads, oracle_ranks.omni_names = reads


def _hf_key(name: str) -> str | None:
    """`name` as `hf_expert_state` renames it (None: folded into another, AutoEP's w3)."""
    from ds_omni.model.expert_checkpoint import hf_shared_expert_key
    from ds_omni.parallelize.expert_parallel import _split_autoep
    head, tail = _split_autoep(name)
    if tail is None:
        return hf_shared_expert_key(name)
    return {"experts.w1": head + "experts.gate_up_proj", "experts.w2": head + "experts.down_proj",
            "router.gate.weight": head + "gate.weight"}.get(tail)


class _Same(dict):
    def __missing__(self, key):
        return key


def _ranks(rank, world, out_dir, stages, planted, model_dir=None, resume=False, llm=None,
           degrees=None):
    results = {}
    for plant in planted:
        seen = {}
        with hf_layout(seen):
            results[f"plant-{plant}"] = oracle.train_on_rank(
                rank, world, make_config(f"{out_dir}/plant-{plant}", 2, degrees=degrees),
                ds_config(1), 1, plant, read_params=oracle_ranks.full_params)  # the patched one
    for stage in stages:
        seen = {}
        with hf_layout(seen):
            results[f"zero{stage}"] = oracle.train_on_rank(
                rank, world, make_config(f"{out_dir}/zero{stage}", 2, model_dir, llm, degrees),
                ds_config(stage), STEPS, resume_at=STEPS - 1 if resume else None,
                read_params=oracle_ranks.full_params)
        results[f"zero{stage}"]["seen"] = seen
    return results


def start_launch(name, tmp_path_factory, fixture):
    """The launch `name` (the `launches` fixture, tests/dist/conftest.py): its ranks' results and
    the model folder it trained (None: the tiny MoE)."""
    world, stages, planted = LAUNCHES[name]
    tmp = tmp_path_factory.mktemp(name)
    model_dir = qwen3_vl_moe_dir(tmp / "q3") if name.endswith("qwen3_vl_moe") else None
    return run_on_ranks(_ranks, world, timeout=600, args=(
        str(tmp / "ep"), stages, plants.for_launch(planted) if planted else [], model_dir,
        name == RESUMED, LLMS.get(name), DEGREES.get(name))), model_dir


def _check(name, per_rank, dp, tmp_path, steps=STEPS, model_dir=None, llm=None, readers=1,
           got=None):
    """`per_rank` (the ranks that read the global batch) against the oracle; `readers`: every
    readers-th rank reads a data-parallel rank's rows (its TP peers train the same); `got`:
    the result compared (default rank 0's; a pipeline's stages merged)."""
    got = got or per_rank[0]
    from ds_omni.model.build import build_model
    cfg = make_config(str(tmp_path / f"ref_{name}"), 1, model_dir, llm)
    want = oracle.reference_step_keys(cfg, build_model(cfg.model), dp, steps)
    for step in range(steps):
        keys = sorted(k for r in per_rank[::readers] for k in r["keys"][step])
        assert keys == want[step], f"{name} step {step}: the ranks trained another batch"
    ref = oracle.run_reference(cfg, want)
    extra, missing = got["params"].keys() - ref.params, ref.params.keys() - got["params"]
    assert not extra and not missing, f"{name}: parameters {sorted(extra)} not in HF's model, " \
        f"{sorted(missing)} missing"
    oracle.assert_matches(ref, got, name)
    oracle.assert_moved(ref, name)
    return ref


@pytest.mark.dist
@pytest.mark.parametrize("launch", [pytest.param("ep2", marks=pytest.mark.slow),
                                    pytest.param("ep2_zero2", marks=pytest.mark.slow),
                                    pytest.param("ep2_dp2", marks=pytest.mark.slow),
                                    pytest.param("ep2_qwen3_vl_moe", marks=pytest.mark.slow),
                                    pytest.param("ep2_zero3", marks=pytest.mark.slow),
                                    pytest.param("ep2_shared_experts", marks=pytest.mark.slow),
                                    pytest.param("ep2_tp2", marks=pytest.mark.slow),
                                    pytest.param("ep2_tp2_zero3", marks=pytest.mark.slow),
                                    pytest.param("ep2_tp2_qwen3_vl_moe",
                                                 marks=pytest.mark.slow),
                                    pytest.param("pp2_ep2", marks=pytest.mark.slow),
                                    pytest.param("pp2_ep2_qwen3_vl_moe",
                                                 marks=pytest.mark.slow)])
def test_expert_parallel_matches_single_process(launch, launches, tmp_path):
    results, model_dir = launches(launch)
    world, stages, _ = LAUNCHES[launch]
    degrees = DEGREES.get(launch, {})
    tp, pp = degrees.get("tp", 1), degrees.get("pp", 1)
    dp = world // tp // pp
    for stage in stages:
        name = f"zero{stage}"
        per_rank = [r[name] for r in results]
        _check_one(f"{launch}-{name}", per_rank, tmp_path, dp, tp, pp, model_dir,
                   LLMS.get(launch))
        if tp > 1:
            _check_folded(per_rank)
        if pp > 1:
            _check_carried(per_rank, dp)
        if pp > 1 and model_dir is not None:  # stage 1 (ranks 2, 3) added deepstack levels
            added = [r["deepstack_levels_added"] for r in per_rank]
            assert added[:2] == [0, 0] and all(n > 0 for n in added[2:]), added
        if launch == RESUMED:
            _check_resume_and_export(per_rank[0], tmp_path)
        for first in range(0, world, world // pp):  # AutoEP's blocks ran, with tokens routed
            stage_ranks = per_rank[first:first + world // pp]
            assert all(r["seen"]["routed"] > 0 for r in stage_ranks), stage_ranks[0]["seen"]
        # both models: 2 MoE layers, over the stages
        assert sum(r["seen"]["autoep_layers"] for r in per_rank[::dp * tp]) == 2
        _check_expert_load(per_rank, tp * pp)


def _check_one(name, per_rank, tmp_path, dp, tp=1, pp=1, model_dir=None, llm=None,
               steps=STEPS) -> None:
    """The ranks of a launch (dp x tp x pp) against the oracle: the first stage's ranks read the
    global batch (every tp-th of them a data-parallel rank's), data-parallel rank 0 of each
    stage holds that stage's gradients and parameters."""
    got = oracle.merge_stages(per_rank[::dp]) if pp > 1 else per_rank[0]
    _check(name, per_rank[:dp * tp], dp, tmp_path, steps, model_dir, llm, readers=tp, got=got)


def _check_expert_load(per_rank: list[dict], replicas: int) -> None:
    """The loop's moe_* metrics (`expert_load`) are the same on every rank, and their most loaded
    layer's tokens are every routed token once (each MoE layer routes every token): the ranks'
    counts per layer, over the tp x pp ranks that each see every token of their rows."""
    loads = [r["seen"]["loads"] for r in per_rank]
    assert all(load == loads[0] for load in loads), "the ranks report different expert loads"
    routed = sum(r["seen"]["routed_total"] / r["seen"]["autoep_layers"] for r in per_rank)
    load_sum = per_rank[0]["seen"]["load_sum"]
    assert load_sum > 0 and load_sum == routed / replicas, (load_sum, routed, replicas)


def _check_carried(per_rank: list[dict], dp: int, steps: int = STEPS) -> None:
    """pp x ep: every stage added each of its MoE layers' router statistics to the carried aux
    loss for every micro-batch it ran (so the last stage's aux holds every layer's)."""
    added = 0
    for first in range(0, len(per_rank), dp):
        for r in per_rank[first:first + dp]:
            seen = r["seen"]
            assert seen["aux_layers_added"] == seen["autoep_layers"] * seen["micro"] * steps, seen
        added += per_rank[first]["seen"]["autoep_layers"]
    assert added == 2, added


def _check_folded(per_rank: list[dict]) -> None:
    """ep x tp ran as the fold: every rank's attention is AutoTP's (q, k, v column-parallel and
    o row-parallel in both layers; the MoE blocks are not AutoTP's), both MoE blocks are
    AutoEP's folded layers, and each TP pair split its rows' token-expert assignments: each rank
    dispatched some but not all, the two together all of them."""
    for r in per_rank:
        assert r["tp_counts"] == {"column": 6, "row": 2}, r["tp_counts"]
        assert r["seen"]["fold"]["folded_layers"] == 2, r["seen"]
    for first in range(0, len(per_rank), 2):
        folds = [r["seen"]["fold"] for r in per_rank[first:first + 2]]
        total = folds[0]["assignments_total"]
        assert total > 0 and all(f["assignments_total"] == total for f in folds), folds
        local = [f["assignments_local"] for f in folds]
        assert sum(local) == total and all(0 < n < total for n in local), folds


def _check_resume_and_export(got: dict, tmp_path) -> None:
    """--resume under ep reruns the last step alike, and the final checkpoint exports to an HF
    directory (experts in HF's layout) holding exactly the parameters the ranks ended with."""
    from transformers import AutoModelForImageTextToText
    from ds_omni.model.convert import consolidate_checkpoint, export_checkpoint
    from ds_omni.train.checkpoint import checkpoint_root
    resumed = got["resumed"]
    assert resumed["losses"] == pytest.approx(got["losses"][STEPS - 1:], rel=1e-6), resumed
    root = checkpoint_root(resumed["output_dir"])
    state = consolidate_checkpoint(root)
    assert state.keys() == got["params"].keys()
    for key, want in got["params"].items():
        assert torch.equal(state[key], want), key
    hf = AutoModelForImageTextToText.from_pretrained(str(export_checkpoint(root, tmp_path / "hf")))
    gate_up = hf.state_dict()["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(gate_up, got["params"]["backbone.layers.0.mlp.experts.gate_up_proj"])


def test_every_ep_plant_has_a_case():
    assert sorted(PLANTED) == sorted(plants.for_launch("ep") + plants.for_launch("ep_pp")
                                     + plants.for_launch("ep_tp")
                                     + plants.for_launch("ep_pp_sp"))


@pytest.mark.dist
@pytest.mark.slow  # the ep2 launch (about 3 min on 2 quiet cores) is the slow tier's
@pytest.mark.parametrize("plant", plants.for_launch("ep"))
def test_plant_is_caught(plant, launches, tmp_path):
    per_rank = [r[f"plant-{plant}"] for r in launches("ep2")[0]]
    with pytest.raises(AssertionError, match=PLANTED[plant]):
        _check(plant, per_rank, 2, tmp_path, steps=1)


@pytest.mark.dist
@pytest.mark.slow  # the 4-rank pp2 x ep2 launch is the slow tier's
@pytest.mark.parametrize("plant", plants.for_launch("ep_pp"))
def test_plant_pp_ep_is_caught(plant, launches, tmp_path):
    """pp2 x ep2: the oracle fails when a stage's EP ranks hold each other's experts, and when
    the first stage's MoE layers are left out of the carried aux loss, or their probabilities'
    gradient out of the stage's backward."""
    per_rank = [r[f"plant-{plant}"] for r in launches("pp2_ep2")[0]]
    with pytest.raises(AssertionError, match=PLANTED[plant]):
        _check_one(plant, per_rank, tmp_path, dp=2, pp=2, steps=1)


@pytest.mark.dist
@pytest.mark.slow  # the 4-rank ep2 x tp2 launch is the slow tier's
@pytest.mark.parametrize("plant", plants.for_launch("ep_tp"))
def test_plant_ep_tp_is_caught(plant, launches, tmp_path):
    """ep2 x tp2: the oracle fails when the fold's gradient corrections are left out: the
    experts' gradients not divided by tp, the router's not averaged over the TP group."""
    per_rank = [r[f"plant-{plant}"] for r in launches("ep2_tp2")[0]]
    with pytest.raises(AssertionError, match=PLANTED[plant]):
        _check_one(plant, per_rank, tmp_path, dp=2, tp=2, steps=1)


def _check_pp_sp(name: str, per_rank: list[dict], tmp_path, steps: int = STEPS):
    """pp2 x sp2 x ep2 (ranks 0, 1 stage 0; 2, 3 stage 1; each stage's pair its SP and EP
    group) against the oracle: the SP ranks read the same rows (dp 1), SP rank 0 of each stage
    holds the stage's gradients and parameters."""
    got = oracle.merge_stages(per_rank[::2])
    return _check(name, per_rank[:2], 1, tmp_path, steps, readers=2, got=got)


@pytest.mark.dist
@pytest.mark.slow  # a 4-rank launch
def test_pp2_sp2_ep2_matches_single_process(launches, tmp_path):
    """pp x ep x sp: exact against one process; each stage's MoE blocks are AutoEP's with
    tokens routed on every rank, every stage added its layers' statistics for every
    micro-batch, the last stage's ranks summed them over their SP group once a micro-batch
    (the first stage's never), and Ulysses split each stage's rows (`_check_sp_ran`)."""
    from ds_omni.parallel.plan import ParallelPlan
    from tests.dist.test_pipeline_composed import _check_sp_ran
    per_rank = [r["zero1"] for r in launches("pp2_sp2_ep2")[0]]
    ref = _check_pp_sp("pp2_sp2_ep2", per_rank, tmp_path)
    _check_carried(per_rank, 2)
    assert all(r["seen"]["routed"] > 0 for r in per_rank), [r["seen"] for r in per_rank]
    sums = [r["seen"]["aux_sp_sums"] for r in per_rank]
    micro = per_rank[0]["seen"]["micro"]
    assert sums == [0, 0, micro * STEPS, micro * STEPS], sums
    cfg = make_config(str(tmp_path / "plan"), 2, degrees=DEGREES["pp2_sp2_ep2"])
    plan = ParallelPlan.from_config(cfg.parallel, 4, cfg.data.reorder)
    _check_sp_ran("zero1", [{"zero1": r} for r in per_rank], plan, ref)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("plant", plants.for_launch("ep_pp_sp"))
def test_plant_pp_sp_ep_is_caught(plant, launches, tmp_path):
    """pp2 x sp2 x ep2: the oracle fails when the last stage forms the aux loss from its own
    SP shard's statistics (not summed over the row's SP group)."""
    per_rank = [r[f"plant-{plant}"] for r in launches("pp2_sp2_ep2")[0]]
    with pytest.raises(AssertionError, match=PLANTED[plant]):
        _check_pp_sp(plant, per_rank, tmp_path, steps=1)

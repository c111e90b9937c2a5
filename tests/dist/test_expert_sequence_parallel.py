"""Expert parallelism inside dp x sp (parallel.ep with Ulysses SP, and with the per-sequence SP
degree) equals one process, exactly.

The model is `test_expert_parallel`'s (Qwen3-MoE, 4 experts, top-2, HF's aux loss on, behind a
CLIP tower). Under SP a sample's tokens are spread over its row's ranks, and HF's aux loss is
not a sum over tokens: each rank sums the sample's expert picks, router probabilities and token
counts over its shard, the row's group adds them up (`ds_omni.model.moe_aux.sp_aux_sum`), and
the aux enters the loss once per sample. The expert-parallel groups are drawn from the
sequence x data ranks (DeepSpeed's AutoEP under ds_omni's SP mpu: consecutive ranks).

Launches, each started once with its cases looped inside (`run_on_ranks`):
- "ep2_sp2": 2 ranks, sp=2, ep=2 (dp=1: the EP group is the SP group; each expert on one rank),
  ZeRO 1 and 2, and the plant;
- "ep2_sp2_dp2": 4 ranks, dp=2 x sp=2, ep=2 (EP groups [0, 1], [2, 3]; each expert's gradient
  reduced over ranks 0, 2 or 1, 3), ZeRO 2;
- "ep2_msp2": 2 ranks, max_sequence_sp=2, ep=2 (dp=2: short rows run on one rank, long ones on
  the 2-rank block, the aux summed over the block), ZeRO 2.
Each is compared with the oracle (`tests/oracle/`: one process, HF's MoE block, the same
global batches): loss (rel 1e-6), every step's reduced gradients and the final parameters
(AutoEP's shards gathered into HF's layout). Counters show the mechanism ran: every split row
summed its aux statistics over its group (`sp_aux_reductions` = the rows run split), Ulysses ran
in every layer of those rows, AutoEP's blocks routed tokens. `test_plant_is_caught`: with the
aux statistics not summed over the group (`moe_aux_not_reduced_over_sp`) the losses differ.
All slow: a 2-rank launch takes minutes on 2 cores (`test_pairs_quick.py` trains ep2 x sp2 with
the encoder pool and ep2 x max_sequence_sp 2 a step or two each in the quick tier).
"""

import pytest

from tests import oracle, plants
from tests.dist.test_expert_parallel import STEPS, hf_layout, make_config
from tests.fixtures import ds_config, long_source
from tests.harness import run_on_ranks
from tests.oracle import ranks as oracle_ranks

pytestmark = pytest.mark.timeout(1500)

# launch -> (world, parallel fields, ZeRO stages, plants)
LAUNCHES = {"ep2_sp2": (2, {"sp": 2}, [1, 2], True),
            "ep2_sp2_dp2": (4, {"sp": 2}, [2], False),
            "ep2_msp2": (2, {"max_sequence_sp": 2}, [2], False)}
PLANTED = {"moe_aux_not_reduced_over_sp": "losses"}
PACK, MAX_LEN = 300, 512  # per-sequence: long samples (~380 tokens) need 2 ranks' micro-batches


def sp_config(out_dir: str, ep: int, parallel: dict, long: dict | None,
              pool: dict | None = None):
    """`test_expert_parallel`'s MoE composition with the SP fields `parallel`; per-sequence SP
    adds the long source and fixed-count reordering over the 2 ranks (as
    `test_sequence_parallel.per_sequence_config`)."""
    from ds_omni.config import ReorderConfig, SourceConfig, from_dict
    cfg = make_config(out_dir, ep)
    cfg.model.llm.config["max_position_embeddings"] = 1024
    if parallel.get("max_sequence_sp", 1) > 1:
        cfg.data.sources.append(from_dict(SourceConfig, long))
        cfg.data.max_seq_len, cfg.data.pack_tokens = MAX_LEN, PACK
        cfg.data.reorder = ReorderConfig(mode="fixed", group_size=2)
    for key, value in parallel.items():  # the reference (ep 1): one process, static SP off
        setattr(cfg.parallel, key, value if ep > 1 or key != "sp" else 1)
    if pool is not None:  # `pool`'s rows alone, in loader order, 4 samples a row (several
        # images to spread); pooled over the dp x sp ranks (as sequence_parallel/pool.py)
        cfg.data.sources, cfg.data.reorder = [from_dict(SourceConfig, pool)], ReorderConfig(
            mode="loader_order")
        cfg.parallel.encoder_pool = "dp" if ep > 1 else "off"
        cfg.train.micro_batch_size = 4
    return cfg


def _ranks(rank, world, out_dir, parallel, stages, planted, long):
    results = {}
    for plant in planted:
        with hf_layout({}):
            results[f"plant-{plant}"] = oracle.train_on_rank(
                rank, world, sp_config(f"{out_dir}/plant-{plant}", 2, parallel, long),
                ds_config(1), 1, plant, read_params=oracle_ranks.full_params)  # patched
    for stage in stages:
        seen = {}
        with hf_layout(seen):
            results[f"zero{stage}"] = oracle.train_on_rank(
                rank, world, sp_config(f"{out_dir}/zero{stage}", 2, parallel, long),
                ds_config(stage), STEPS, read_params=oracle_ranks.full_params)  # patched
        results[f"zero{stage}"]["seen"] = seen
    return results


def start_launch(name, tmp_path_factory, fixture):
    """The launch `name` (the `launches` fixture, tests/dist/conftest.py): its ranks' results
    and the long-sequence source it read."""
    world, parallel, stages, planted = LAUNCHES[name]
    tmp = tmp_path_factory.mktemp(name)
    (tmp / "long").mkdir()
    long = long_source(tmp / "long", weight=0.3, words=300)
    return run_on_ranks(_ranks, world, timeout=900, args=(
        str(tmp / "ep"), parallel, stages, plants.for_launch("ep_sp") if planted else [],
        long)), long


def _check(name, launch, per_rank, long, tmp_path, steps=STEPS, split_work=True):
    world, parallel, _, _ = LAUNCHES[launch]
    return check_parallel(name, world, parallel, per_rank, long, tmp_path, steps, split_work)


def check_parallel(name, world, parallel, per_rank, long, tmp_path, steps=STEPS,
                   split_work=True, pool=None):
    """`per_rank` (`world` ranks under the SP fields `parallel`) against the oracle; `pool`: the
    source the ranks pooled the encoders of (`sp_config`)."""
    from ds_omni.model.build import build_model
    dp = world // parallel.get("sp", 1)
    cfg = sp_config(str(tmp_path / f"ref_{name}"), 1, parallel, long, pool)
    want = oracle.reference_step_keys(cfg, build_model(cfg.model), dp, steps)
    sp = parallel.get("sp", 1)
    for step in range(steps):  # the ranks of an SP group report the same samples
        got = sorted(k for r in per_rank[::sp] for k in r["keys"][step])
        assert got == want[step], f"{name} step {step}: the ranks trained another batch"
    ref = oracle.run_reference(cfg, want)
    oracle.assert_matches(ref, per_rank[0], name)
    if split_work:
        oracle.assert_split_work(ref, per_rank, name, pooled=pool is not None)
        oracle.assert_moved(ref, name)
    return ref


def _assert_aux_reduced(name, per_rank):
    """Every row run split summed its aux statistics over its group, once a forward."""
    assert sum(r["sp_rows"] for r in per_rank) > 0, f"{name}: no row ran split"
    for rank, r in enumerate(per_rank):
        counts = r["sp"]
        assert counts["sp_aux_reductions"] == r["sp_rows"], (
            f"{name} rank {rank}: {counts['sp_aux_reductions']} aux reductions for "
            f"{r['sp_rows']} split rows")
        assert r["seen"]["autoep_layers"] == 2 and r["seen"]["routed"] > 0, (name, r["seen"])


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_expert_parallel_inside_sp_matches_single_process(launch, launches, tmp_path):
    results, long = launches(launch)
    for stage in LAUNCHES[launch][2]:
        name = f"{launch}-zero{stage}"
        per_rank = [r[f"zero{stage}"] for r in results]
        _check(name, launch, per_rank, long, tmp_path)
        _assert_aux_reduced(name, per_rank)


def test_every_ep_sp_plant_has_a_case():
    assert sorted(PLANTED) == plants.for_launch("ep_sp")


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("plant", plants.for_launch("ep_sp"))
def test_plant_is_caught(plant, launches, tmp_path):
    results, long = launches("ep2_sp2")
    per_rank = [r[f"plant-{plant}"] for r in results]
    with pytest.raises(AssertionError, match=PLANTED[plant]):
        _check(plant, "ep2_sp2", per_rank, long, tmp_path, steps=1, split_work=False)

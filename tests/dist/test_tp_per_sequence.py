"""Tensor parallelism beside the per-sequence SP degree (parallel.tp x parallel.max_sequence_sp)
equals one process.

One 4-rank launch (the slow tier's: the quick tier's pairwise launch, `test_pairs_quick.py`,
trains this case for 2 steps), ranks started once for every case: tp2 x dp2 with
max_sequence_sp 2 (reorder group of the 2 data-parallel ranks). TP rank t's ranks are t and t + 2;
a long sequence (more tokens than a micro-batch, an image inside) runs on a block of both
data-parallel ranks OF ONE TP RANK (global ranks 0 and 2, and 1 and 3: its Ulysses all-to-alls
never mix TP shards), its image resharded inside the block; the other rows run whole, each TP
group splitting their items (`tp_encoders`). LLaVA under ZeRO-1 and 3, 3 steps, against the oracle
(`tests/oracle/`: loss, every step's gradients with the TP shards gathered whole, parameters);
and the mechanisms shown to run: AutoTP's layers, blocks with items on every TP rank's slice
(`check_per_sequence` per slice: each target once, different shards, Ulysses calls), the TP
encoder split on the rows run whole.

`test_plant_is_caught`: a block drawn across TP ranks, and a block row's encoder gradients summed
over TP (`tests/plants/tensor_parallel.py`), each fail the oracle.
"""

import pytest

from tests import oracle, plants
from tests.dist.sequence_parallel.per_sequence import check_per_sequence, per_sequence_config
from tests.fixtures import ds_config, long_source
from tests.harness import run_on_ranks

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

STEPS, TP, DP = 3, 2, 2
CASES = {"tp_msp_llava": {"stage": 1, "steps": STEPS},
         "tp_msp_llava_zero3": {"stage": 3, "steps": STEPS},
         **{p: {"stage": 1, "steps": 1, "plant": p} for p in plants.for_launch("tp_msp")}}


def _config(out_dir: str, long: dict):
    cfg = per_sequence_config({"llava": {}}, "llava", out_dir, DP, long)  # blocks of 2 dp ranks
    cfg.parallel.tp = TP
    return cfg


def _train_ranks(rank, world, long, out_dir):
    return {name: oracle.train_on_rank(rank, world, _config(f"{out_dir}/{name}", long),
                                       ds_config(case["stage"]), case["steps"], case.get("plant"))
            for name, case in CASES.items()}


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_msp")
    long = long_source(tmp, weight=0.3, words=300)
    return long, run_on_ranks(_train_ranks, TP * DP, args=(long, str(tmp / "runs")), timeout=600)


def _check(name, launch, tmp_path) -> None:
    long, results = launch
    check_case(name, [r[name] for r in results], long, CASES[name]["steps"], tmp_path)


def check_case(name, per_rank, long, steps, tmp_path) -> None:
    """Case `name` (`per_rank`: each rank's result, `steps` trained) against the oracle, each
    TP rank's slice's blocks, and AutoTP's layers on every rank."""
    cfg = _config(str(tmp_path / f"ref_{name}"), long)
    whole = {k: per_rank[0][k] for k in ("grads", "step_params", "params")}  # rank 0's only
    for t in range(TP):  # TP rank t's slice (ranks t, t + 2): blocks of its dp ranks
        ranks = per_rank[t::TP]
        check_per_sequence(f"{name} TP rank {t}", cfg, DP, [{**ranks[0], **whole}, *ranks[1:]],
                           steps)
    for rank, r in enumerate(per_rank):  # a TP group's ranks (2g, 2g + 1) train alike
        peer = per_rank[rank // TP * TP]
        assert r["keys"] == peer["keys"] and r["losses"] == peer["losses"], (name, rank)
        assert r["tp_counts"] == {"column": 10, "row": 4}, (name, rank, r["tp_counts"])


def _check_tp_encode(per_rank) -> None:
    """The rows run whole were split over each TP group's ranks (some items each, all together);
    a block's row was not (`TPEncoders.place` passes it on)."""
    for first in range(0, len(per_rank), TP):
        group = [r["tp_encode"] for r in per_rank[first:first + TP]]
        assert len({g["row_items"] for g in group}) == 1, group
        assert sum(g["items_encoded"] for g in group) == group[0]["row_items"] > 0, group
        assert all(g["grads_summed"] > 0 for g in group), group
    for r in per_rank:  # every micro-batch: a block's row, or one split over TP
        assert r["tp_encode"]["rows"] + r["block_rows"] == len(r["shards"]), r["tp_encode"]


@pytest.mark.dist
def test_tp_x_max_sequence_sp_matches_single_process(launch, tmp_path):
    _check("tp_msp_llava", launch, tmp_path)
    _check_tp_encode([r["tp_msp_llava"] for r in launch[1]])


@pytest.mark.dist
def test_tp_x_max_sequence_sp_zero3_matches_single_process(launch, tmp_path):
    """The same under ZeRO-3: each TP shard partitioned over its TP rank's dp ranks, which
    hold every block of that TP rank."""
    _check("tp_msp_llava_zero3", launch, tmp_path)


@pytest.mark.dist
@pytest.mark.parametrize("plant", plants.for_launch("tp_msp"))
def test_plant_is_caught(plant, launch, tmp_path):
    with pytest.raises(AssertionError, match="losses|grad of"):
        _check(plant, launch, tmp_path)

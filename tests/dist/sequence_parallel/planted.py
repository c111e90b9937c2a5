"""Planted errors of the 2-rank launch (tests/plants/sequence_parallel.py: two resharded rows
swapped, a block's `sp_block` ignored, whole rows on every SP rank, a reader's wrong pixels), one
step each; `test_plant_is_caught` shows the checks fail on each."""

from tests import oracle
from tests.dist.sequence_parallel.harness import make_config
from tests.dist.sequence_parallel.per_sequence import per_sequence_config
from tests.fixtures import ds_config

# One step each, in the 2-rank launch: plant -> (kind of case, family, ZeRO).
# "static": sp=2 on 2 ranks (make_config); "per_sequence": the per-sequence degree (PER_SEQUENCE).
PLANTED = {"reshard_rows_swapped": ("static", "llava", 0),
           "sp_block_ignored": ("per_sequence", "llava", 1),
           "sp_whole_row": ("static", "llava", 0),
           "reader_wrong_pixels": ("static", "llava", 0)}
# what each failure names: swapped rows and a block's row attended shard by shard change the loss
# itself; whole rows on both SP ranks leave loss and gradients exact (ZeRO sums the SP group's
# gradients: doubled targets and loss cancel), only the split-work checks see them
CAUGHT_BY = {"reshard_rows_swapped": "losses .*, the reference's",
             "sp_block_ignored": "losses .*, the reference's",
             "sp_whole_row": "trained on more than one rank",
             "reader_wrong_pixels": "losses .*, the reference's"}


def planted_config(families, plant: str, out_dir: str, long: dict):
    kind, family, _ = PLANTED[plant]
    if kind == "per_sequence":
        return per_sequence_config(families, family, out_dir, 2, long)
    return make_config(families[family], out_dir, sp=2, reorder=False)


def train(rank, launch, families, out_dir) -> dict:
    results = {}
    for plant in launch.planted:
        cfg = planted_config(families, plant, f"{out_dir}/plant-{plant}", launch.long)
        results[f"plant-{plant}"] = oracle.train_on_rank(rank, launch.world, cfg,
                                                         ds_config(PLANTED[plant][2]), 1, plant)
    return results

"""Static Ulysses SP (sp=2) with adaptive resharding, on 2 ranks (sp=2) or 4 (dp=2 x sp=2).

The 11 design cases and the encoder pool's 2 (pool.POOL) cover every pair of values of every two
axes (family x stage, family x world, family x reordering, stage x world, stage x reordering,
world x reordering) at least once, with only 5 cases on 4 ranks; `test_design_covers_every_pair`
checks that.
- llava: the demo composition (CLIP + Llama, 4 query / 2 KV heads);
- qwen2_vl: an HF directory (native-resolution images, 3-D M-RoPE positions), with a text-only
  source mixed in, so that some rows have no image at all;
- composed: CLIP + Whisper + Qwen2 with ONE KV head (fewer KV heads than sp ranks), images and
  audio clips in the same rows, plus text-only rows.
llava_next, qwen2_audio and gemma3 (bidirectional image blocks, sliding windows) add one case
each. SPLIT_ALL cases encode every image and clip over both ranks of its SP group
(`parallel.encoder_sp` 0), the others run the "auto" threshold.
"""

from tests import oracle
from tests.dist.sequence_parallel.harness import STEPS, case_name, check_case, make_config
from tests.fixtures import ds_config

#          family      ZeRO world reorder   (4-rank cases are the costly ones: as few as cover)
# (composed, ZeRO-1, 4 ranks) is the encoder pool case pool.POOL, which counts towards the pairs
DESIGN = [("llava", 3, 4, False), ("qwen2_vl", 0, 4, True),
          ("llava", 2, 4, True),
          ("llava", 0, 2, False), ("llava", 1, 2, True),
          ("qwen2_vl", 1, 2, False), ("qwen2_vl", 2, 2, False), ("qwen2_vl", 3, 2, True),
          ("composed", 0, 2, True), ("composed", 2, 2, True), ("composed", 3, 2, False)]
# ZeRO-3 + Ulysses + recomputed decoder layers (the all-to-alls run again in backward)
CHECKPOINTED = {("llava", 3, 4, False)}
# validation under ZeRO-3 + SP after the last step: equal to one process evaluating the whole set
EVALUATED = {("qwen2_vl", 3, 2, True)}
# the other two families train under SP too (any-resolution tiles; Whisper clips)
EXTRA = [("llava_next", 2, 2, False), ("qwen2_audio", 3, 2, True),
         # Gemma 3 through the generic adapter: image blocks attended both ways and 4-token
         # sliding windows, over the whole row that Ulysses gathers per head
         ("gemma3", 1, 2, False)]
# long-short SP for encoders with threshold 0: EVERY image and clip is encoded by both ranks of its
# SP group, a piece each (Ulysses inside the tower); under ZeRO-3 the other groups' ranks top up
# with dummy encoder runs. The other cases run the default "auto" threshold.
SPLIT_ALL = {("llava", 3, 4, False), ("qwen2_vl", 1, 2, False), ("composed", 3, 2, False),
             ("qwen2_audio", 3, 2, True)}


def cases(world: int) -> list:
    return [c for c in DESIGN + EXTRA if c[2] == world]


def train(rank, launch, families, out_dir) -> dict:
    results = {}
    for case in cases(launch.world):
        family, stage, _, reorder = case
        cfg = make_config(families[family], f"{out_dir}/{case_name(case)}", sp=2, reorder=reorder,
                          evaluate=case in EVALUATED)
        cfg.model.activation_checkpointing = case in CHECKPOINTED
        if case in SPLIT_ALL:
            cfg.parallel.encoder_sp = 0.0
        results[case_name(case)] = oracle.train_on_rank(rank, launch.world, cfg, ds_config(stage),
                                                         STEPS)
    return results


def check(launch, families, tmp_path) -> None:
    results, dp = launch.results, launch.world // 2
    for case in cases(launch.world):
        name = case_name(case)
        cfg = make_config(families[case[0]], str(tmp_path / f"ref_{name}"), sp=1, reorder=False,
                          evaluate=case in EVALUATED)
        check_case(name, cfg, dp, [r[name] for r in results])
        if case in SPLIT_ALL:  # items really were split over the group
            assert sum(r[name]["long_items"] for r in results) > 0, name

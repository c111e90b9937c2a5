"""The two-stage recipe (`examples/two_stage/`) in one process, each run as `ds-omni train` runs it
(the CLI's own `main`), for tests/e2e/test_two_stage.py:

1. `stage1/`: stage 1 for 3 steps;
2. `stage2/`: stage 2 from `stage1/hf` for 2 steps, the model it built written out before its
   first step to `stage2_start/` (the same `export_hf` that wrote stage 1's export);
3. `stage2_resumed/`: stage 2 again, stopped with a checkpoint after 1 step, then `--resume`d.

Only the output folders, stage 2's `model.pretrained` (stage 1's export there), steps and batch
sizes are set (`--set`); every other field is the shipped file's.

    python -m tests.e2e.two_stage_run WORK_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "two_stage"
DS_CONFIG = REPO / "ds_configs" / "zero2.json"
SIZES = ["train.global_batch_size=4", "train.micro_batch_size=2", "train.warmup_steps=1"]


def _train(stage: str, out: Path, steps: int, *extra: str, sets: tuple[str, ...] = ()) -> int:
    from ds_omni.cli import main
    args = ["train", "--config", str(EXAMPLES / stage), "--deepspeed", str(DS_CONFIG), *extra]
    for field in (f"train.output_dir={out}", f"train.steps={steps}", *SIZES, *sets):
        args += ["--set", field]
    print(f"two_stage_run: {' '.join(args)}", flush=True)
    return main(args)


def _write_start(out: Path):
    """Wrap the composition root's `build_model`: the model it returns is exported to `out`."""
    from ds_omni.model.convert import export_hf
    from ds_omni.train import setup
    build = setup.build_model

    def build_and_write(cfg):
        built = build(cfg)
        export_hf(built.model, out, built.tokenizer)
        return built
    setup.build_model = build_and_write
    return build


def run_all(work: Path) -> int:
    from ds_omni.train import setup
    stage1 = work / "stage1"
    sets = (f"model.pretrained={stage1 / 'hf'}",)
    status = _train("stage1_align.json", stage1, 3)
    if status:
        return status
    build = _write_start(work / "stage2_start")
    try:
        status = _train("stage2_finetune.json", work / "stage2", 2, sets=sets)
    finally:
        setup.build_model = build
    if status:
        return status
    resumed = work / "stage2_resumed"
    return (_train("stage2_finetune.json", resumed, 2, "--stop-after", "1", sets=sets)
            or _train("stage2_finetune.json", resumed, 2, "--resume", sets=sets))


if __name__ == "__main__":
    sys.exit(run_all(Path(sys.argv[1])))

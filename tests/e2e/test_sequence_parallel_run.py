"""Ulysses SP through the real launcher: sp=2 on 2 ranks, ZeRO-3, a rank killed in a backward,
resume (with data workers), export.

One SP group of 2 ranks trains the same global batches as one process alone (dp=1 in both), so
across the kill and a resume the run must reproduce, step for step, the oracle of
`tests/oracle/` run here in the test process (plain PyTorch on a loader-built batch): the same
samples and the same losses; and its checkpoint exports to a HuggingFace directory.
"""

import json
import time
from pathlib import Path

import pytest

from ds_omni.train.metrics import read_metrics
from tests import oracle
from tests.e2e.faulty import fired_at
from tests.e2e.launch import launcher_cmd, run, train, write_configs
from tests.fixtures import tiny_config

pytestmark = pytest.mark.e2e
STEPS = 4


# In the slow tier (about 70 s; it kept `make test` over 12 minutes with its set-up): each of its
# mechanisms keeps a quick check: SP=2 against one process (tests/dist/test_sequence_parallel.py),
# a killed rank restarted and resumed (test_launchers.py's torchrun run), the export of a launcher
# run (test_launchers.py's deepspeed run), the SP counters (every SP parity case).
@pytest.mark.slow
def test_sp2_killed_in_a_backward_resumes_exports_and_matches_one_process(tmp_path):
    cfg, ds, out = write_configs(tmp_path / "sp", stage=3, steps=STEPS, export_hf=True,
                                 save_every=2, peer_timeout_s=10)
    # every image encoded by both ranks, a piece each (long-short SP with threshold 0)
    split = ("--set", "parallel.sp=2", "--set", "parallel.encoder_sp=0")
    # rank 1 dies (SIGKILL) in the backward of step 2, right after the save of step 2 (one of the
    # deepspeed launcher's kill points; the others: tests/e2e/test_resume.py): every process ends
    # within a bounded time, the survivor naming the dead rank
    first = run(launcher_cmd("deepspeed", 2)[:-1] + [
        "tests.e2e.faulty", "train", "--config", cfg, "--deepspeed", ds, *split],
        env={"DS_OMNI_TEST_FAULTS": "kill:1:backward:2", "DS_OMNI_TEST_FAULT_DIR": str(tmp_path)})
    ended = time.time()
    assert first.returncode != 0 and "rank 1 is gone" in first.stdout, first.stdout[-3000:]
    assert ended - fired_at(tmp_path, 1)[0] < 30
    # resumed with the loading in a worker process per rank: the same steps
    second = train("deepspeed", 2, cfg, ds, *split, "--set", "data.workers=1", "--resume")
    assert second.returncode == 0, second.stdout[-3000:]

    from ds_omni.model.build import build_model
    ref_cfg = tiny_config(str(tmp_path / "ref"), steps=STEPS)
    want_keys = oracle.reference_step_keys(ref_cfg, build_model(ref_cfg.model), 1, STEPS)
    want = oracle.run_reference(ref_cfg, want_keys)
    got = read_metrics(out)
    assert [r["step"] for r in got] == list(range(STEPS))
    assert [r["sample_keys"] for r in got] == want_keys
    assert [r["loss"] for r in got] == pytest.approx(want.losses, rel=1e-5)
    assert all(r["data_long_items"] > 0 for r in got)
    # the SP machinery ran (ds_omni.parallel.evidence, counted since each process started)
    assert all(r["sp_ulysses_calls"] > 0 and r["sp_encoder_pieces"] > 0 for r in got)
    report = json.loads((Path(out) / "report.json").read_text())
    assert report["sp"] == 2 and report["dp"] == 1
    from transformers import AutoConfig
    assert AutoConfig.from_pretrained(Path(out) / "hf").model_type == "llava"

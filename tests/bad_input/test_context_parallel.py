"""Bad parallel.cp inputs: refused at start-up, before any process group, by one line that names
the values and the fix."""

from tests.bad_input.common import config, no_training, refused, says, write  # noqa: F401
from tests.unit.parallelize.test_expert_parallel import MOE


def test_cp_that_does_not_divide_the_rows_chunks(tmp_path, capsys, monkeypatch):
    cfg = config(tmp_path / "out")
    cfg["parallel"] = {"cp": 3}
    monkeypatch.setenv("WORLD_SIZE", "3")
    err = refused(capsys, *write(tmp_path, cfg))
    says(err, "parallel.cp=3 x parallel.sp=1", "data.max_seq_len=128", "6 chunks",
         "set data.max_seq_len to 126 or 132")


def test_cp_with_ep_under_zero3_is_refused_by_the_table(tmp_path, capsys, monkeypatch):
    """ep x cp composes under ZeRO 1 and 2 only (DeepSpeed's expert reduction, as under sp)."""
    from tests.fixtures import ds_config
    cfg = config(tmp_path / "out")
    cfg["model"]["llm"]["config"] = dict(MOE)
    cfg["parallel"] = {"cp": 2, "ep": 2}
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = refused(capsys, *write(tmp_path, cfg, ds_config(3)))
    says(err, "parallel.ep=2", "parallel.cp=2", "zero_optimization.stage=3",
         "set zero_optimization.stage to 1 or 2")


def test_cp_with_attention_dropout(tmp_path, capsys, monkeypatch):
    cfg = config(tmp_path / "out")
    cfg["model"]["llm"]["config"]["attention_dropout"] = 0.1
    cfg["parallel"] = {"cp": 2}
    monkeypatch.setenv("WORLD_SIZE", "2")
    says(refused(capsys, *write(tmp_path, cfg)), "attention_dropout 0.1", "parallel.cp to 1")


def test_cp_with_pipeline_is_refused_by_the_table(tmp_path, capsys, monkeypatch):
    cfg = config(tmp_path / "out")
    cfg["parallel"] = {"cp": 2, "pp": 2}
    monkeypatch.setenv("WORLD_SIZE", "4")
    says(refused(capsys, *write(tmp_path, cfg)), "parallel.pp=2", "parallel.cp=2",
         "set parallel.cp or parallel.pp to 1")


def test_a_good_cp_plan_starts(tmp_path, capsys, monkeypatch, no_training):  # noqa: F811
    from tests.bad_input.common import train
    cfg = config(tmp_path / "out")
    cfg["parallel"] = {"sp": 2, "cp": 2}
    monkeypatch.setenv("WORLD_SIZE", "4")
    code, err = train(capsys, *write(tmp_path, cfg))
    assert code == "started", err

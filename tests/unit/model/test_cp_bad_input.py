"""Bad input for ring attention (parallel.cp) fails before launch, naming the offending value
and the fix: a data.max_seq_len the row's zigzag chunks do not divide; an LLM whose attention
cannot run as a ring (a family without sequence parallelism, per-sample layers such as
Qwen3.5's gated delta net, attention dropout; an MoE LLM runs it); a sequence longer than every
block can hold (per-sequence SP, whose blocks past the heads now run a ring, so raising
parallel.max_sequence_sp is a fix)."""

import pytest

from ds_omni.config import ModelConfig, ParallelConfig
from ds_omni.errors import DataError, ModelError
from ds_omni.config.composition import check_model_fits
from ds_omni.model.build import model_facts
from tests.fixtures import TINY_LLAMA, ds_config, tiny_config


def _plan(tmp_path, cp: int = 2, sp: int = 1, max_seq_len: int = 128, **llm):
    from ds_omni.train.setup import plan_run
    cfg = tiny_config(str(tmp_path))
    cfg.model.llm.config = {**TINY_LLAMA, **llm}
    cfg.parallel = ParallelConfig(cp=cp, sp=sp)
    cfg.data.max_seq_len = max_seq_len
    return plan_run(cfg, ds_config(2), cp * sp)[0]


def _check_ring(model: ModelConfig) -> None:
    """The composition table's model checks of cp=2 over `model`, rows of 128 tokens."""
    check_model_fits(ParallelConfig(cp=2), model_facts(model, 128))


def test_cp_must_divide_the_rows_chunks(tmp_path):
    assert _plan(tmp_path, cp=2, sp=2, max_seq_len=128).cp == 2  # 128 = 16 x 8 chunks
    with pytest.raises(ModelError, match=r"parallel.cp=2 x parallel.sp=2: data.max_seq_len=130 "
                                         r"is not a multiple of the row's 8 chunks .* set "
                                         r"data.max_seq_len to 128 or 136"):
        _plan(tmp_path, cp=2, sp=2, max_seq_len=130)


@pytest.mark.parametrize("llm,match", [
    ({"attention_dropout": 0.1}, r"parallel.cp=2: model.llm has attention_dropout 0.1, which "
     r"ring attention does not apply; set it to 0 in the LLM's config, or set parallel.cp to 1"),
])
def test_an_llm_the_ring_cannot_split_is_refused(tmp_path, llm, match):
    with pytest.raises(ModelError, match=match):
        _plan(tmp_path, **llm)


def test_an_moe_llm_runs_the_ring(tmp_path):
    """An MoE LLM splits over the ring: its aux statistics are summed at the zigzag positions
    (tests/dist/test_context_parallel_composed.py)."""
    assert _plan(tmp_path, model_type="mixtral", num_local_experts=4).cp == 2


def test_per_sample_layers_are_refused(tmp_path):
    from ds_omni.coverage import sweep
    sweep.config_for("qwen3_5").save_pretrained(str(tmp_path))  # the config alone
    with pytest.raises(ModelError, match=r"(?s)parallel.cp=2: .*linear_attention.*gated delta "
                                         r"net.*set parallel.cp and parallel.max_sequence_sp to 1"):
        _check_ring(ModelConfig(pretrained=str(tmp_path)))


def test_a_family_without_sequence_parallelism_is_named(tmp_path, monkeypatch):
    from tests.family_dirs import make_llava_dir
    from ds_omni.model.families import family_for
    monkeypatch.setattr(family_for("llava"), "sequence_parallel", False)
    with pytest.raises(ModelError, match=r"parallel.cp=2: the 'llava' family's attention cannot "
                                         r"be split over ranks .*set parallel.cp to 1"):
        _check_ring(ModelConfig(pretrained=str(make_llava_dir(tmp_path))))


def test_a_sequence_longer_than_every_block_names_the_fix():
    from ds_omni.parallel.hdp import degree_for
    with pytest.raises(DataError, match=r"a sequence of 801 tokens needs 9 micro-batches of 100 "
                                        r"tokens, more than the largest SP group \(8 ranks\); "
                                        r"raise parallel.max_sequence_sp or data.pack_tokens, or "
                                        r"lower data.max_seq_len"):
        degree_for(0.1, 801, 1.0, 100, 8)

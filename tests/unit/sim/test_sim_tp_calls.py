"""What tensor parallelism's collectives cost as training runs them (issue 37's CPU validation
under-predicted every TP plan): AutoTP all-reduces the input gradient of each column-parallel
matrix in backward, the activations cross in the training dtype, each call pays the fitted
call cost, and the encoder gradients are summed one parameter tensor at a time."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from ds_omni.data.cost import EncoderDims, ModelDims
from ds_omni.sim import comm
from ds_omni.sim.cluster import cluster
from ds_omni.sim.model_parallel import ATTENTION_COLUMNS, encoder_grads_seconds
from ds_omni.sim.model_spec import ModelSpec
from ds_omni.sim.plan_spec import SimPlan
from ds_omni.sim.step import simulate
from ds_omni.sim.workload import Samples

L, H, ROW, M = 4, 1024, 4096, 4  # layers, width, tokens a packed row, micro-batches


def text_model(bytes_per_param: int = 2) -> ModelSpec:
    """A gated-MLP LLM (q, k, v apart: AutoTP's 3 + 2 column-parallel matrices a layer) with a
    frozen vision tower (no encoder gradients to sum)."""
    dims = ModelDims(hidden=H, layers=L, intermediate=4 * H, vocab=32000,
                     encoders={"vision": EncoderDims(hidden=256, layers=2, intermediate=1024)})
    return dataclasses.replace(ModelSpec.from_dims(dims, frozen=("vision",)),
                               bytes_per_param=bytes_per_param)


def text_rows() -> Samples:
    empty = np.zeros(0, dtype=np.int64)
    return Samples(np.full(2 * M, ROW // 2, dtype=np.int64), empty, np.array([], dtype=str),
                   empty, empty)


PLAN = SimPlan(tp=2, global_batch=2 * M, micro_batches=M, pack_tokens=ROW, checkpointing=False,
               autotp_calls=True)


def test_autotp_all_reduces_each_column_parallel_input_gradient():
    """Backward, a rank all-reduces its rows' input gradient once per column-parallel matrix
    (q, k, v, gate, up: 5 a layer, as a profile of training counts them in AutoTP's
    `LinearLayer` backward), not once for attention and once for the MLP (fused layers:
    `autotp_calls` off, the default the GPU studies keep)."""
    c, m = cluster("h100", 2, 2), text_model()
    autotp = simulate(c, m, text_rows(), PLAN)
    fused = simulate(c, m, text_rows(), PLAN.replace(autotp_calls=False))
    one = comm.all_reduce(ROW * H * 2, 2, comm.link_of(c, [0, 1]))
    extra = M * L * (ATTENTION_COLUMNS + m.dims.mlp_matrices - 1 - 2)
    assert ATTENTION_COLUMNS + m.dims.mlp_matrices - 1 == 5
    assert autotp.comm[0] - fused.comm[0] == pytest.approx(extra * one, rel=1e-9)


def test_tp_activations_cross_in_the_training_dtype_and_each_call_pays_its_cost():
    """fp32 training (`bytes_per_param` 4, the CPU validation's) all-reduces twice bf16's
    bytes; every TP all-reduce (2 a layer forward, 5 backward) pays `Cluster.a2a_call_s`."""
    c = cluster("h100", 2, 2)
    bf16 = simulate(c, text_model(2), text_rows(), PLAN)
    fp32 = simulate(c, text_model(4), text_rows(), PLAN)
    assert fp32.all_to_all_bytes["llm_tp"] == pytest.approx(2 * bf16.all_to_all_bytes["llm_tp"])
    paid = simulate(dataclasses.replace(c, a2a_call_s=1e-3), text_model(2), text_rows(), PLAN)
    assert paid.comm[0] - bf16.comm[0] == pytest.approx(M * L * (2 + 5) * 1e-3, rel=1e-9)


def test_encoder_gradients_are_summed_one_tensor_at_a_time():
    """Under `tp_encodes_apart` a hook all-reduces each trainable encoder tensor
    (`tp_encoders.sum_grads_over_tp`): one call per tensor (the validation's tiny ViT and
    projector: 43), each paying its latencies, where one call of all the bytes paid them once."""
    model = ModelSpec.from_dims(ModelDims(hidden=256, layers=2, intermediate=512, vocab=1000,
                                          encoders={"vision": EncoderDims(
                                              hidden=32, layers=2, intermediate=64)}))
    assert model.encoder_tensors("vision") == 43
    nbytes = model.encoder_params("vision") * model.bytes_per_param
    c = cluster("cpu", 2, 2)
    link = comm.link_of(c, [0, 1])
    step = SimpleNamespace(model=model, cluster=c, pplan=SimpleNamespace(tp=2),
                           plan=SimpleNamespace(autotp_calls=True))
    per_tensor = encoder_grads_seconds(step, nbytes, link)
    assert per_tensor == pytest.approx(43 * comm.all_reduce(nbytes / 43, 2, link), rel=1e-9)
    assert per_tensor - comm.all_reduce(nbytes, 2, link) == pytest.approx(
        42 * 2 * link.latency, rel=1e-6)  # 42 more calls of 2 (p - 1) latencies


@pytest.mark.slow
def test_encoder_tensors_counts_the_built_models(tmp_path):
    """`ModelSpec.encoder_tensors` against the model training builds: the validation's tiny
    ViT and projector (`sim_validation`'s ep2_tp2_moe) hold 43 trainable tensors."""
    from benchmarks.sim_validation import config, flop_model
    from ds_omni.model.build import build_model
    from tests.fixtures import long_source, text_source
    sources = {"text": text_source(tmp_path),
               "long": long_source(tmp_path, weight=0.14, words=1200)}
    cfg = config("ep2_tp2_moe", str(tmp_path), sources, 1)
    built = build_model(cfg.model).model
    tensors = [p for name, p in built.named_parameters()
               if name.startswith("encoders.vision") and p.requires_grad]
    assert flop_model(cfg).encoder_tensors("vision") == len(tensors) == 43

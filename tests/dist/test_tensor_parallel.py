"""The LLM backbone tensor-parallel (parallel.tp, DeepSpeed's AutoTP layers) equals one process.

Two ranks (tp=2, so dp=1: both ranks read the same rows) train 3 optimizer steps through
DeepSpeed under ZeRO 1 and 2 with grouped reordering on (the default "fixed" mode), and each
case is compared with the oracle (`tests/oracle/`: one process, plain PyTorch, the same
global batches made there): the losses (rel 1e-6), the full reduced gradients of every step (the ranks' shards gathered whole,
`ds_omni.parallelize.tensor_parallel.gather_tp`), and the parameters after the last step.

Cases: the tiny LLaVA (Llama: 4 query / 2 key-value heads, no biases) and Qwen2-VL (3-D M-RoPE
positions, q/k/v biases sharded with their rows, a text-only source mixed in); and LLaVA with a
Qwen2 LLM of ONE key-value head (fewer than tp: DeepSpeed gives rank 0 the whole attention and
rank 1 a zero-width share, see the module docstring of `tensor_parallel`); and a Qwen2 LLM with
per-layer window types (layer 0 full, layer 1 a sliding window of 8 tokens, shorter than its
packed samples): the TP ranks keep each layer's window, and the same model without it trains
other losses, so the match needed the window (`_check_window_applies`); and Qwen3.5's LLM (a gated
delta net layer, run once per sample of the packed row, its projections split with their output
gathered, and q/k norms whose gradients AutoTP sums over TP). Packed rows
(cu_seqlens) throughout. The mechanism is shown to run: the backbone's 14 projections are
AutoTP's layers, each rank holds half of the MLP, and the encoders are whole; the TP ranks of a
group encode different items of their row (each some, together all of them; the rows
all-gathered) and sum the encoders' gradients over TP (`_check_tp_encode`).

On 4 ranks (slow tier, one launch; `test_pairs_quick.py` trains tp x sp and tp x the pool a step
each in the quick tier): LLaVA and Qwen2-VL at tp2 x dp2 under ZeRO 1 and 2, LLaVA
also with the encoder pool (each TP
rank pools over its data-parallel ranks; dp rank 0's rows hold every image, so items move), and
tp x sp: tp2 x sp2 (dp=1; SP groups
[0, 2] and [1, 3], one per TP rank) for LLaVA under ZeRO 1 and 2 and Qwen2-VL (text-only rows
among its rows) under ZeRO-2, 3 steps each, against one process the same way; both mechanisms are
shown to run (AutoTP's layers on every rank; Ulysses attention in every decoder layer of every
row, each SP group's ranks on different shards, each target trained once per TP rank:
`oracle.assert_split_work` over the ranks of one TP rank). `test_plant_tp_sp_is_caught`: ZeRO's
sequence x data group built across the TP ranks (as without tp) is caught.

Under ZeRO-3 (slow tier, 4 ranks): LLaVA at tp2 x dp2, each TP shard partitioned again over its
TP rank's data-parallel ranks (DeepSpeed 0.19.8 supports AutoTP with ZeRO-3).

On 8 ranks (slow tier, one launch): all three axes, tp2 x sp2 x dp2 (two data-parallel groups
of 4 ranks, TP innermost, then SP), LLaVA under ZeRO-2, checked the same way.

`test_plant_is_caught` / `test_plant_slow_is_caught`: the oracle fails on each planted error
(`tests/plants/`: the column-parallel input gradient not summed over the TP ranks, which
leaves the loss alone and moves only the gradients of what is below: norms, embedding,
projector, vision tower; the encoders' gradients not summed over the TP ranks, which leaves
each rank only its items' part; in Qwen2-VL, a column shard's bias added twice, and the
embedding rows' gradient summed over the TP ranks in the gather's backward, tp x too large).
"""

import re

import pytest

from tests import oracle, plants
from tests.fixtures import ds_config, text_source, tiny_config
from tests.harness import run_on_ranks

# a launch's ranks run inside the test that first needs them: more than the suite's 600 s on a
# slow or loaded machine (their own run_on_ranks timeouts bound each launch)
pytestmark = pytest.mark.timeout(1500)

STEPS = 3
ONE_KV = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
          "max_position_embeddings": 256, "tie_word_embeddings": False}
# Qwen2 with per-layer window types: layer 0 full, layer 1 a sliding window of 8 tokens, shorter
# than the packed samples (an image's 16 tokens and the caption), so the window cuts
WINDOWED = {**ONE_KV, "num_key_value_heads": 2, "use_sliding_window": True, "sliding_window": 8,
            "max_window_layers": 1}
# Qwen3.5's LLM: a gated delta net layer (run once per sample of a packed row,
# `ds_omni.model.per_sample`; its projections column-split with the output gathered, as HF's
# plan says) and a full-attention layer whose q/k norms see half the heads on each TP rank
# (`replicated_with_grad_allreduce`: their gradient summed over TP by AutoTP's hooks)
PER_SAMPLE_LAYERS = {**ONE_KV, "model_type": "qwen3_5_text", "num_key_value_heads": 2,
                     "head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
                     "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                     "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                     "linear_conv_kernel_dim": 4}


def _config(case: dict, out_dir: str):
    from ds_omni.config import ParallelConfig, SourceConfig, from_dict
    cfg = tiny_config(out_dir, steps=case.get("steps", STEPS), weight_decay=0.1)
    cfg.parallel = ParallelConfig(tp=2, sp=case.get("sp", 1))
    if case.get("model_dir"):
        cfg.model.pretrained, cfg.model.tokenizer = case["model_dir"], None
        cfg.model.vision = cfg.model.llm = None
    if case.get("llm"):
        cfg.model.llm.config = dict(case["llm"])
    if case.get("sources"):
        cfg.data.sources = [from_dict(SourceConfig, s) for s in case["sources"]]
    if case.get("pool"):  # the encoder pool over each TP rank's data-parallel ranks, loader order
        from ds_omni.config import ReorderConfig
        cfg.parallel.encoder_pool, cfg.data.reorder = "dp", ReorderConfig(mode="loader_order")
    if case.get("micro_batch_size"):  # samples per packed row
        cfg.train.micro_batch_size = case["micro_batch_size"]
    return cfg


def _train_ranks(rank, world, cases, out_dir):
    results = {}
    for name, case in cases.items():
        for stage in case["stages"]:
            cfg = _config(case, f"{out_dir}/{name}{stage}")
            results[(name, stage)] = oracle.train_on_rank(
                rank, world, cfg, ds_config(stage), case.get("steps", STEPS), case.get("plant"),
                case.get("resume_at"))
    return results


def _planted(honest: dict, launch: str, base: str) -> dict:
    """A 1-step case of `base` for each plant of `launch`."""
    return {p: {**{k: v for k, v in honest[base].items() if k != "resume_at"}, "steps": 1,
                "plant": p} for p in plants.for_launch(launch)}


@pytest.fixture(scope="module")
def quick_cases():
    """The quick tier's launch: LLaVA under ZeRO-2, and its plant."""
    honest = {"llava": {"stages": [2]}}
    cases = {**honest, **_planted(honest, "tp", "llava")}
    # the peer's pixels count only for the items it encodes (its share of each row): in one step
    # it may encode none, so this plant trains as many steps as the honest case
    cases["tp_reader_wrong_pixels"]["steps"] = STEPS
    return cases


@pytest.fixture(scope="module")
def slow_cases(tmp_path_factory):
    from tests import family_dirs
    tmp = tmp_path_factory.mktemp("tp")
    shapes = {"name": "shapes", "path": "builtin:shapes"}
    honest = {
        "llava": {"stages": [1], "resume_at": 2},  # saved, resumed, exported to HF
        "qwen2_vl": {"stages": [1, 2], "model_dir": str(family_dirs.make_qwen2_vl_dir(tmp / "q")),
                     "sources": [shapes, text_source(tmp)]},
        "one_kv_head": {"stages": [1], "llm": ONE_KV},
        "sliding_window": {"stages": [2], "llm": WINDOWED},
        "per_sample_layers": {"stages": [1], "llm": PER_SAMPLE_LAYERS},
    }
    planted = _planted(honest, "tp_slow", "qwen2_vl")
    return {**honest, **{p: {**c, "stages": [2]} for p, c in planted.items()}}


@pytest.fixture(scope="module")
def quick_results(quick_cases, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_runs")
    return run_on_ranks(_train_ranks, 2, args=(quick_cases, str(out)), timeout=600)


@pytest.fixture(scope="module")
def slow_results(slow_cases, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_slow_runs")
    return run_on_ranks(_train_ranks, 2, args=(slow_cases, str(out)), timeout=900)


def _check(name, case, results, tmp_path, dp=1):
    from ds_omni.model.build import build_model
    steps = case.get("steps", STEPS)
    cfg = _config(case, str(tmp_path / f"ref_{name}"))
    step_keys = oracle.reference_step_keys(cfg, build_model(cfg.model), dp, steps)
    ref = oracle.run_reference(cfg, step_keys)
    for stage in case["stages"]:
        got = results[0][(name, stage)]
        # the TP ranks of a group read the same rows; the groups together the global batch
        rank_keys = [sorted(k for r in results[::2] for k in r[(name, stage)]["keys"][s])
                     for s in range(steps)]
        assert rank_keys == step_keys, (name, stage)
        for rank, r in enumerate(results):  # rank 2g + 1 reads what rank 2g reads
            peer = results[rank // 2 * 2]
            assert r[(name, stage)]["keys"] == peer[(name, stage)]["keys"], (name, stage)
        _check_one_reader(name, stage, results)
        oracle.assert_matches(ref, got, f"{name} tp=2 dp={dp} ZeRO-{stage}")
        assert all(r[(name, stage)]["losses"] == got["losses"] for r in results), (name, stage)
        if "resume_at" in case:
            _check_resume(name, stage, case["resume_at"], results)
            _check_export(name, results[0][(name, stage)]["resumed"]["output_dir"],
                          got["params"])
    oracle.assert_moved(ref, name)
    return ref


def _check_one_reader(name, stage, results) -> None:
    """One reader per TP group (`data.shared_reading`): rank 2g read the rows and decoded the
    images, its TP peer 2g + 1 read and decoded nothing (it got the reader's micro-batches).
    A reader's own rows may hold no image (reordering places them by cost): the readers together
    decoded some."""
    decoded = 0
    for rank, r in enumerate(results):
        rows, _, items = r[(name, stage)]["read_counts"]
        if rank % 2:
            assert rows == items == 0, f"{name}: TP peer rank {rank} read {rows} rows, {items} items"
        else:
            assert rows > 0, f"{name}: reader rank {rank} read no rows"
            decoded += items
    assert decoded > 0, f"{name}: the readers decoded no image"


def _check_resume(name, stage, at, results) -> None:
    """Resumed on the same plan from the checkpoint saved before step `at`, every rank trained
    the same samples to the same losses and parameters, bit for bit."""
    for r in results:
        again = r[(name, stage)]["resumed"]
        assert again["start"] == at and again["keys"] == r[(name, stage)]["keys"][at:], name
        assert again["losses"] == r[(name, stage)]["losses"][at:], name
        assert not again["params_differ"], (name, again["params_differ"][:3])


def _check_export(name, output_dir, params) -> None:
    from tests.dist import pipeline
    pipeline._check_export(name, output_dir, params)  # the TP shards made whole, exactly


@pytest.mark.dist
def test_tensor_parallel_matches_single_process(quick_cases, quick_results, tmp_path):
    _check("llava", quick_cases["llava"], quick_results, tmp_path)
    _check_shards(quick_results, "llava", 2)
    _check_sharded_params(quick_cases["llava"], quick_results, "llava", 2, tmp_path)
    _check_tp_encode(quick_results, "llava", 2)


@pytest.mark.dist
@pytest.mark.slow
def test_tensor_parallel_families_match_single_process(slow_cases, slow_results, tmp_path):
    for name, case in slow_cases.items():
        if "plant" not in case:
            _check(name, case, slow_results, tmp_path)
    _check_shards(slow_results, "qwen2_vl", 2)
    _check_sharded_params(slow_cases["qwen2_vl"], slow_results, "qwen2_vl", 2, tmp_path)
    for name, case in slow_cases.items():
        if "plant" not in case:
            _check_tp_encode(slow_results, name, case["stages"][0])
    # one KV head, tp=2: rank 0 holds the whole attention (4 query heads and the KV head of 16
    # dims; o_proj all of its input), rank 1 zero-width shares of each; the MLP is halved
    attn = {"q_proj.weight": [(64, 64), (0, 64)], "k_proj.weight": [(16, 64), (0, 64)],
            "v_proj.weight": [(16, 64), (0, 64)], "o_proj.weight": [(64, 64), (64, 0)]}
    for leaf, want in attn.items():
        got = [r[("one_kv_head", 1)]["local_shapes"][f"backbone.layers.0.self_attn.{leaf}"]
               for r in slow_results]
        assert got == want, (leaf, got)
    assert all(r[("one_kv_head", 1)]["local_shapes"]["backbone.layers.0.mlp.up_proj.weight"]
               == (64, 64) for r in slow_results)
    _check_window_applies(slow_cases["sliding_window"], slow_results, tmp_path)
    _check_per_sample_layer_split(slow_cases["per_sample_layers"], slow_results, tmp_path)


def _check_per_sample_layer_split(case, results, tmp_path) -> None:
    """Qwen3.5 under TP: the gated delta net's projections (a layer run per sample) hold half of
    their output rows on each rank, its other parameters and the q/k norms of the attention
    layer stay whole; `_check` showed the result exact (the norms' gradients summed over TP)."""
    from ds_omni.model.build import build_model
    whole = {n: tuple(p.shape) for n, p in
             build_model(_config(case, str(tmp_path / "shapes_q35")).model).model
             .named_parameters()}
    layer = "backbone.layers.0.linear_attn."
    split = [f"{layer}{p}.weight" for p in ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                             "in_proj_a", "out_proj")]
    for r in results:
        local = r[("per_sample_layers", 1)]["local_shapes"]
        for n in split:
            assert local[n] == (whole[n][0] // 2, whole[n][1]), (n, local[n], whole[n])
        for n in (f"{layer}conv1d.weight", f"{layer}A_log",
                  "backbone.layers.1.self_attn.q_norm.weight"):
            assert local[n] == whole[n], (n, local[n], whole[n])


def _check_window_applies(case, results, tmp_path) -> None:
    """The sliding window really ran under TP: each rank's sharded backbone kept its layers'
    windows (full, then 8), and the same model without the window trains other losses on the
    same rows, so the TP run's match with the windowed reference (`_check`) needed the window."""
    from ds_omni.model.build import build_model
    for r in results:
        got = r[("sliding_window", 2)]["layer_windows"]
        assert got == [None, 8], got
    cfg = _config({**case, "llm": {**case["llm"], "use_sliding_window": False}},
                  str(tmp_path / "ref_no_window"))
    full = oracle.run_reference(
        cfg, oracle.reference_step_keys(cfg, build_model(cfg.model), 1, STEPS)).losses
    got = results[0][("sliding_window", 2)]["losses"]
    assert all(abs(a - b) > 1e-4 * abs(b) for a, b in zip(got, full)), (got, full)


# the parameters AutoTP splits: the decoder layers' projections, and the column layers' biases
SPLIT = re.compile(r"backbone\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
                   r"\.weight"
                   r"|backbone\.layers\.\d+\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.bias")


def _check_sharded_params(case, results, name, stage, tmp_path) -> None:
    """Which parameters are sharded over TP, against the whole model's shapes: exactly the
    decoder layers' projections (`SPLIT`); the embedding and LM head are whole, [V, D], on every
    rank (the module docstring of `tensor_parallel` says why), as are the norms and encoders."""
    from ds_omni.model.build import build_model
    whole = {n: tuple(p.shape) for n, p in
             build_model(_config(case, str(tmp_path / f"shapes_{name}")).model).model
             .named_parameters()}
    expected = {n for n in whole if SPLIT.fullmatch(n)}
    assert expected, (name, sorted(whole)[:5])
    for rank, r in enumerate(results):
        local = r[(name, stage)]["local_shapes"]
        assert set(local) == set(whole), (name, rank)
        split = {n for n, shape in local.items() if shape != whole[n]}
        assert split == expected, (name, rank, sorted(split ^ expected))
        for n in ("backbone.embed_tokens.weight", "backbone.lm_head.weight"):
            assert local[n] == whole[n] and len(whole[n]) == 2, (name, rank, n, local[n])


def _check_tp_encode(results, name, stage, tp=2) -> None:
    """The encoders' split over the TP ranks ran (`ds_omni.parallelize.tp_encoders`): the TP
    ranks of a group placed the same rows, each encoded only its share of their items (some,
    not all), the shares add up to the rows' items, and the gradients were summed over TP."""
    for first in range(0, len(results), tp):
        group = [r[(name, stage)]["tp_encode"] for r in results[first:first + tp]]
        rows, items = {g["rows"] for g in group}, {g["row_items"] for g in group}
        assert len(rows) == 1 and len(items) == 1, (name, group)
        encoded = [g["items_encoded"] for g in group]
        assert sum(encoded) == group[0]["row_items"] > 0, (name, encoded, group[0])
        assert all(0 < n < group[0]["row_items"] for n in encoded), (name, encoded)
        assert len({g["gathers"] for g in group}) == 1 and group[0]["gathers"] > 0, (name, group)
        summed = {g["grads_summed"] for g in group}  # one per encoder parameter per backward
        assert len(summed) == 1 and summed.pop() > 0, (name, group)


def _check_shards(results, name, stage) -> None:
    """The mechanism ran: 2 layers x (q, k, v, gate, up) column-parallel and x (o, down)
    row-parallel; each rank holds half of every MLP projection; nothing else is split."""
    for r in results:
        got = r[(name, stage)]
        assert got["tp_counts"] == {"column": 10, "row": 4}, (name, got["tp_counts"])
        shapes = got["local_shapes"]
        assert shapes["backbone.layers.0.mlp.gate_proj.weight"] == (64, 64), name  # of 128
        assert shapes["backbone.layers.0.mlp.down_proj.weight"] == (64, 64), name
    whole = [{n: s for n, s in r[(name, stage)]["local_shapes"].items()
              if "backbone.layers" not in n} for r in results]
    assert all(w == whole[0] for w in whole), name


@pytest.mark.dist
@pytest.mark.parametrize("plant", plants.for_launch("tp"))
def test_plant_is_caught(plant, quick_cases, quick_results, tmp_path):
    with pytest.raises(AssertionError):
        _check(plant, quick_cases[plant], quick_results, tmp_path)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("plant", plants.for_launch("tp_slow"))
def test_plant_slow_is_caught(plant, slow_cases, slow_results, tmp_path):
    with pytest.raises(AssertionError):
        _check(plant, slow_cases[plant], slow_results, tmp_path)


@pytest.fixture(scope="module")
def four_cases(tmp_path_factory):
    """dp=2 x tp=2: two TP groups, each its own rows: LLaVA and Qwen2-VL under ZeRO 1 and 2;
    tp=2 x sp=2 (dp=1): two SP groups ([0, 2], [1, 3]), one per TP rank, all four ranks on the
    same rows: LLaVA under ZeRO 1 and 2, Qwen2-VL (M-RoPE, text-only rows) under ZeRO-2; and the
    tp x sp plant."""
    return four_cases_in(tmp_path_factory.mktemp("tp_four"))


def four_cases_in(tmp) -> dict:
    from tests import family_dirs
    qwen2_vl = {"model_dir": str(family_dirs.make_qwen2_vl_dir(tmp / "q")),
                "sources": [{"name": "shapes", "path": "builtin:shapes"}, text_source(tmp)]}
    from tests.data_files import skewed_source
    skewed = skewed_source(tmp / "skewed", dp=2)  # dp rank 0's rows hold every image
    honest = {"llava": {"stages": [1, 2]}, "qwen2_vl": {"stages": [1, 2], **qwen2_vl},
              "tp_sp_llava": {"stages": [1, 2], "sp": 2},
              "tp_pool_llava": {"stages": [2], "pool": True, "sources": [skewed]},
              "tp_sp_qwen2_vl": {"stages": [2], "sp": 2, **qwen2_vl}}
    planted = _planted(honest, "tp_sp", "tp_sp_llava")
    return {**honest, **{p: {**c, "stages": [2]} for p, c in planted.items()}}


@pytest.fixture(scope="module")
def four_results(four_cases, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_four_runs")
    return run_on_ranks(_train_ranks, 4, args=(four_cases, str(out)), timeout=1200)


@pytest.mark.dist
@pytest.mark.slow
def test_tp2_x_dp2_matches_single_process(four_cases, four_results, tmp_path):
    for name in ("llava", "qwen2_vl"):
        _check(name, four_cases[name], four_results, tmp_path, dp=2)
        _check_shards(four_results, name, 2)
        groups = [four_results[r][(name, 2)]["keys"] for r in (0, 2)]
        assert groups[0] != groups[1], name  # the two TP groups read different rows
    _check_tp_encode(four_results, "llava", 2)


def _check_tp_sp(name, case, results, tmp_path, dp=1) -> None:
    """tp=2 x sp=2 (x dp) against one process: the 2 x 2 ranks of a data-parallel group (4
    consecutive ranks, TP innermost) trained its rows; loss, every step's gradients (TP shards
    gathered whole) and the parameters match the oracle; and both mechanisms ran: AutoTP's
    layers on every rank, and the Ulysses work split inside each TP rank's SP groups
    (`oracle.assert_split_work` over the ranks of one TP rank: their targets add up to the
    global batch's once)."""
    from ds_omni.model.build import build_model
    steps = case.get("steps", STEPS)
    cfg = _config(case, str(tmp_path / f"ref_{name}"))
    step_keys = oracle.reference_step_keys(cfg, build_model(cfg.model), dp, steps)
    ref = oracle.run_reference(cfg, step_keys)
    for stage in case["stages"]:
        where = f"{name} tp=2 x sp=2 x dp={dp} ZeRO-{stage}"
        per_rank = [r[(name, stage)] for r in results]
        groups = [per_rank[g:g + 4] for g in range(0, len(per_rank), 4)]
        assert all(r["keys"] == group[0]["keys"] for group in groups for r in group), where
        assert [sorted(k for g in groups for k in g[0]["keys"][s]) for s in range(steps)] \
            == step_keys, where
        oracle.assert_matches(ref, per_rank[0], where)
        assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank), where
        for t in range(2):  # the SP groups of TP rank t: global ranks t, t + 2 (+ 4, t + 6)
            oracle.assert_split_work(ref, [_in_tp_slice(r) for r in per_rank[t::2]],
                                     f"{where} TP rank {t}", pooled=case.get("pool", False))
    oracle.assert_moved(ref, name)


def _in_tp_slice(result: dict) -> dict:
    """A rank's result with its SP groups renamed into its TP rank's slice of the world (rank r
    is r // tp there), as `oracle.assert_split_work` reads groups of consecutive ranks."""
    shards = [(step, i, None if g is None else (g[0] // 2, g[1]), ids, n, real)
              for step, i, g, ids, n, real in result["shards"]]
    return {**result, "shards": shards}


@pytest.mark.dist
@pytest.mark.slow
def test_tp2_x_dp2_encoder_pool_matches_single_process(four_cases, four_results, tmp_path):
    """The encoder pool at tp2 x dp2: each TP rank pools over its data-parallel ranks (0 with 2,
    1 with 3); the rows of dp rank 0 hold every image, so dp rank 1's ranks encode some of them,
    both TP ranks of a group the same ones."""
    _check("tp_pool_llava", four_cases["tp_pool_llava"], four_results, tmp_path, dp=2)
    moved = [r[("tp_pool_llava", 2)]["pool_items_moved"] for r in four_results]
    assert moved[2] > 0 and moved[2] == moved[3], moved


@pytest.mark.dist
@pytest.mark.slow
def test_tp2_x_sp2_matches_single_process(four_cases, four_results, tmp_path):
    for name in ("tp_sp_llava", "tp_sp_qwen2_vl"):
        _check_tp_sp(name, four_cases[name], four_results, tmp_path)
        for stage in four_cases[name]["stages"]:
            _check_shards(four_results, name, stage)
    # Qwen2-VL's text-only rows really were split too (no image to reshard)
    assert sum(r[("tp_sp_qwen2_vl", 2)]["row_without_items"] for r in four_results) > 0


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("plant", plants.for_launch("tp_sp"))
def test_plant_tp_sp_is_caught(plant, four_cases, four_results, tmp_path):
    with pytest.raises(AssertionError):
        _check_tp_sp(plant, four_cases[plant], four_results, tmp_path)


@pytest.fixture(scope="module")
def eight_cases(tmp_path_factory):
    return eight_cases_in(tmp_path_factory.mktemp("tp_eight"))


def eight_cases_in(tmp) -> dict:
    """tp=2 x sp=2 x dp=2 on 8 ranks: two data-parallel groups of 4 (TP innermost, then SP), each
    its own rows, each TP rank's SP groups inside them; again with the encoder pool (each TP
    rank pools over its 4 dp x sp ranks; dp rank 0's rows hold every image), and its plant."""
    from tests.data_files import skewed_source
    honest = {"tp_sp_dp_llava": {"stages": [2], "sp": 2},
              # rows of 4 samples: 4 images a row of dp rank 0, 2 of them encoded by dp rank 1
              "tp_sp_pool_llava": {"stages": [2], "sp": 2, "pool": True, "micro_batch_size": 4,
                                   "sources": [skewed_source(tmp / "skewed", dp=2)]}}
    return {**honest, **_planted(honest, "tp_sp_pool", "tp_sp_pool_llava")}


@pytest.fixture(scope="module")
def eight_results(eight_cases, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_eight_runs")
    return run_on_ranks(_train_ranks, 8, args=(eight_cases, str(out)), timeout=1200)


@pytest.mark.dist
@pytest.mark.slow
def test_tp2_x_sp2_x_dp2_matches_single_process(eight_cases, eight_results, tmp_path):
    _check_tp_sp("tp_sp_dp_llava", eight_cases["tp_sp_dp_llava"], eight_results, tmp_path, dp=2)
    _check_shards(eight_results, "tp_sp_dp_llava", 2)
    groups = [eight_results[r][("tp_sp_dp_llava", 2)]["keys"] for r in (0, 4)]
    assert groups[0] != groups[1]  # the two data-parallel groups read different rows


@pytest.mark.dist
@pytest.mark.slow
def test_tp2_x_sp2_x_dp2_encoder_pool_matches_single_process(eight_cases, eight_results,
                                                             tmp_path):
    """The encoder pool under tp x sp: each TP rank pools over its dp x sp ranks (0, 2, 4, 6 and
    1, 3, 5, 7); the rows of dp rank 0 (ranks 0-3) hold every image, so dp rank 1's ranks encode
    some of them, both TP ranks of a pair the same ones."""
    _check_tp_sp("tp_sp_pool_llava", eight_cases["tp_sp_pool_llava"], eight_results, tmp_path,
                 dp=2)
    _check_shards(eight_results, "tp_sp_pool_llava", 2)
    moved = [r[("tp_sp_pool_llava", 2)]["pool_items_moved"] for r in eight_results]
    assert sum(moved[4:]) > 0 and moved[0::2] == moved[1::2], moved


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("plant", plants.for_launch("tp_sp_pool"))
def test_plant_tp_sp_pool_is_caught(plant, eight_cases, eight_results, tmp_path):
    with pytest.raises(AssertionError, match="losses|grad of"):
        _check_tp_sp(plant, eight_cases[plant], eight_results, tmp_path, dp=2)


@pytest.fixture(scope="module")
def zero3_cases():
    """tp=2 x dp=2 under ZeRO-3: each TP shard partitioned again over its TP rank's
    data-parallel ranks (0 with 2, 1 with 3). (tp x sp under ZeRO-3 is refused: the
    composition table says why.)"""
    return {"llava": {"stages": [3]}}


@pytest.fixture(scope="module")
def zero3_results(zero3_cases, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_zero3_runs")
    return run_on_ranks(_train_ranks, 4, args=(zero3_cases, str(out)), timeout=900)


@pytest.mark.dist
@pytest.mark.slow
def test_tp2_x_dp2_zero3_matches_single_process(zero3_cases, zero3_results, tmp_path):
    _check("llava", zero3_cases["llava"], zero3_results, tmp_path, dp=2)
    _check_shards(zero3_results, "llava", 3)
    _check_tp_encode(zero3_results, "llava", 3)

"""Checks of the LLM over pipeline stages (DeepSpeed's pipeline engine) against one process.

The cases train in `test_parity.py`'s 2-rank launch (PP=2, dp=1, 3 steps each; one launch for
all): the tiny LLaVA with its encoder on stage 0 (ZeRO-1) and the image+audio composition with
"uniform" placement (ZeRO-0; 3 decoder layers split as Megatron-LM does, `parallel.stage_split`
"layers": 1 + 2, where the cost model would split 2 + 1). The oracle
(`tests/oracle/`: plain PyTorch, one process, global batches built independently) must match the
loss (1e-6 relative), every step's reduced gradients, each stage's clipping coefficient (ZeRO-0)
and the final parameters (each tensor to 0.1 % of its update; fp32), under weight decay and the LR
schedule of `test_parity.py`. Each stage returns its own parameters under the OmniModel's names; together they must be
the whole model, and under "uniform" (every stage holds the encoders) every copy of an encoder
parameter must be the same, while each is in one stage's optimizer only (its owner's, read from
DeepSpeed's ZeRO-0 optimizer; both stages own some). The PP=2 "uniform" case clips the gradient
norm to 0.05, below every step's norm, so a norm that counted an encoder parameter twice (or
missed the ones stage 1 owns) would clip by another factor. Each rank of a "uniform" case must
have taken part in every owner's broadcast after every step (`EncoderShards.broadcasts`). The
data mixes captioned pictures (with a clip of beeps for the
composition) with plain sentences, so some micro-batches carry no item and token counts differ
from one micro-batch to the next. Each case also saves a checkpoint before its last step, and
after it resumes from that checkpoint and trains the step again: the same samples, losses and
parameters, bit for bit (under "uniform" stage 1's optimizer state holds the encoder parameters
it owns); the final checkpoint exports (DeepSpeed's per-layer files) to an HF
directory that transformers loads, with exactly the trained weights.
"bubbles" (`pp_composed_bubbles`: the composition split by cost, in loader order so items sit in
later micro-batches) is checked as "uniform" is, and some item's forward must have run in an
idle slot (`items_in_gaps`); two plants (rows received after the forward that needed them, an
encoder backward skipped in the cool-down) must fail it.
DP2 x PP2 (both placements) trains in `test_parity.py`'s 4-rank launch, checked the same way
(`dp=2`: the reference trains the global batches of 2 data-parallel loaders). The slow tier
(`test_parity_slow.py`) adds PP=4 (both placements, ZeRO-1, 6 decoder layers) and "uniform" under
ZeRO-1 at PP=2 (clipped, resumed and exported as the ZeRO-0 case).
"""

from tests import oracle

JOINT = ("uniform", "bubbles")  # the placements that put encoders on every stage
LR = 1e-3  # tiny_config's learning rate
CLIP = 0.05  # gradient_clipping of the clipped "uniform" case: below every step's norm there

COMPOSED = {"tokenizer": "builtin:shapes",
            "vision": {"config": {"model_type": "clip_vision_model", "hidden_size": 32,
                                  "intermediate_size": 64, "num_hidden_layers": 1,
                                  "num_attention_heads": 4, "image_size": 32, "patch_size": 8}},
            "audio": {"config": {"model_type": "whisper", "d_model": 32, "encoder_layers": 1,
                                 "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                                 "decoder_layers": 1, "decoder_attention_heads": 2,
                                 "decoder_ffn_dim": 32, "num_mel_bins": 80,
                                 "max_source_positions": 50}},
            "llm": {"config": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 3, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "max_position_embeddings": 512,
                               "tie_word_embeddings": False}}}
SHAPES_TONES = {"name": "shapes_tones", "path": "builtin:shapes_tones",
                "schema": {"text": "conversations", "image": "image", "audio": "audio"}}


def check(name: str, case: dict, results: list, cfg, dp: int = 1, lr_at=None) -> None:
    """Case `name` of `results` (one dict per rank) equals the reference of `cfg` (step k at LR
    `lr_at(k)`)."""
    from ds_omni.model.build import build_model
    steps = case["steps"]
    built = build_model(cfg.model)
    step_keys = oracle.reference_step_keys(cfg, built, dp, steps)
    got_keys = [sorted(k for r in results[:dp] for k in r[name]["keys"][s]) for s in range(steps)]
    assert got_keys == step_keys, f"{name}: the ranks trained another global batch"
    assert all(r[name]["losses"] == results[0][name]["losses"] for r in results), name
    if "parts" in case:  # the boundaries of the case's `parallel.stage_split`
        assert all(r[name]["parts"] == case["parts"] for r in results), \
            (name, results[0][name]["parts"])
    heads = [r[name] for r in results[::dp]]  # data-parallel rank 0 of each stage
    got = oracle.merge_stages(heads)  # under "uniform" an encoder's copy is the last stage's
    ref = oracle.run_reference(cfg, step_keys, case.get("clip", 1.0), lr_at)
    if "clip" in case:  # the clipping acts: a norm counted wrong would clip by another factor
        assert min(ref.grad_norms) > 2 * case["clip"], (name, ref.grad_norms)
    # against the oracle first: a planted error is named by what differs from one process
    oracle.assert_matches(ref, got, f"{name} PP={len(heads)} dp={dp}")
    oracle.assert_moved(ref, name)
    _check_replicas(case["placement"], heads)
    if case["placement"] in JOINT and case["stages"] == [0]:
        _check_owners(heads, {n for n, p in built.model.named_parameters()
                              if p.requires_grad and n.startswith("encoders.")})
    # "uniform": after each step, every owner stage's broadcast (one bucket: fp32), on every rank
    broadcasts = steps * len(heads) if case["placement"] in JOINT else 0
    assert [r[name]["encoder_broadcasts"] for r in results] == [broadcasts] * len(results), name
    assert sum(r[name]["nothing_to_encode"] for r in results) > 0, name
    if case["placement"] == "bubbles":  # some item's forward ran inside an idle slot
        assert sum(r[name]["items_in_gaps"] for r in results) > 0, name
    if "resume_at" in case:
        _check_resume(name, case, results)
        _check_export(name, results[0][name]["resumed"]["output_dir"], got["params"])


def _check_resume(name, case, results) -> None:
    """Resumed from the checkpoint saved before step `resume_at`, the ranks trained the same
    samples to the same losses and parameters, bit for bit."""
    at = case["resume_at"]
    for r in results:
        again = r[name]["resumed"]
        assert again["start"] == at, (name, again["start"])
        assert again["keys"] == r[name]["keys"][at:], f"{name}: resumed at another data position"
        assert again["losses"] == r[name]["losses"][at:], f"{name}: resumed losses differ"
        assert not again["params_differ"], f"{name}: resumed parameters differ: " \
                                           f"{again['params_differ'][:3]}"


def _check_export(name, output_dir, params) -> None:
    """`ds-omni convert --checkpoint` of the final pipeline checkpoint (per-layer files) is an HF
    directory that transformers loads, holding exactly the trained weights."""
    from pathlib import Path
    import torch
    from ds_omni.model.convert import export_checkpoint, model_from_meta
    ckpt = Path(output_dir) / "checkpoints"
    out = export_checkpoint(ckpt, Path(output_dir) / "hf")
    omni, _ = model_from_meta(ckpt / "model")
    hf_state = type(omni.hf_model).from_pretrained(out).state_dict()
    key_map = omni.hf_key_map()
    assert set(hf_state) == set(key_map) and set(params) <= set(key_map.values()), name
    for hf_key, omni_key in key_map.items():
        if omni_key in params:  # buffers (no parameter) are not trained
            assert torch.equal(hf_state[hf_key], params[omni_key]), (name, hf_key)


def _check_owners(heads, encoders: set[str]) -> None:
    """Under "uniform" each trainable encoder parameter (`encoders`) is in the optimizer of one
    stage only, and every stage owns some (read from DeepSpeed's ZeRO-0 optimizer, whose groups
    hold the parameters; `heads`: one rank's results per stage)."""
    owned = [set(head["optimizer_encoders"]) for head in heads]
    assert all(owned) and sum(map(len, owned)) == len(set().union(*owned)), owned
    assert set().union(*owned) == encoders, sorted(encoders - set().union(*owned))[:3]


def _check_replicas(placement, heads) -> None:
    """Only "uniform" holds a parameter on more than one stage: the encoders, on every stage,
    every copy the same."""
    from collections import Counter
    import torch
    held = Counter(k for head in heads for k in head["params"])
    shared = {k for k, n in held.items() if n > 1}
    if placement == "stage0":
        assert not shared, f"a parameter on 2 stages: {sorted(shared)[:3]}"
        return
    assert shared and all(k.startswith("encoders.") and held[k] == len(heads) for k in shared), \
        sorted(shared)[:3]
    for head in heads:
        assert {k for k in head["params"] if k.startswith("encoders.")} == shared
        for key in shared:
            assert torch.equal(head["params"][key], heads[0]["params"][key]), key

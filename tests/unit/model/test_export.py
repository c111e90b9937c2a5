"""Exporting a model to HF leaves the live model as it was (it may go on training)."""

import torch

from tests.family_checks import processor_for


def test_export_does_not_change_the_live_models_packed_attention(tmp_path):
    from ds_omni.model.build import build_model
    from ds_omni.model.convert import export_hf
    from ds_omni.data.packing import pack
    from tests.fixtures import tiny_config
    built = build_model(tiny_config(str(tmp_path / "run")).model)
    proc = processor_for(built)
    samples = [proc(text=f"caption number {i} " * (3 + i), media={}, sample_id=f"s{i}",
                    source="t") for i in range(2)]
    mb = pack(samples, built.item_processors)
    with torch.no_grad():
        before = built.model.logits(mb)
        export_hf(built.model, tmp_path / "hf", built.tokenizer)
        after = built.model.logits(mb)
    # the second sample attends only to itself before and after: any leak moves its logits
    assert torch.equal(before, after)
    assert built.model.backbone.layers[0].self_attn.config._attn_implementation == "ds_omni_packed"

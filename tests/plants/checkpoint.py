"""Planted errors of the model-parallel checkpoint export (tests/unit/model/test_consolidate.py,
and the slow launch of tests/dist/test_checkpoint_plans.py)."""

from tests.plants.registry import patched, plant


@plant("export_tp_wrong_dim", "the export joins each AutoTP shard along the other dim (a "
       "column-parallel weight's shards side by side instead of stacked)", "ckpt_export")
def _export_tp_wrong_dim(rank: int):
    import torch
    from ds_omni.model import convert

    def planted(states, layout, where):
        out = dict(states[0])
        for name, split in layout.items():
            out[name] = torch.cat([s[name] for s in states], dim=1 - split["dim"])
        return out
    yield from patched(convert, "merge_tp", lambda f: planted)


@plant("export_stage_layer_offset", "the export maps a pipeline's decoder layer i to the "
       "OmniModel's layer i + 1 (the last to layer 0): a stage's layer index offset wrong",
       "ckpt_export")
def _export_stage_layer_offset(rank: int):
    from ds_omni.model import convert

    def make(original):
        def planted(model):
            prefixes = original(model)
            decoders = prefixes[1:-1]
            return [prefixes[0], *decoders[1:], decoders[0], prefixes[-1]]
        return planted
    yield from patched(convert, "pipeline_prefixes", make)

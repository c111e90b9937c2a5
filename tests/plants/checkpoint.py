"""Planted errors of the model-parallel checkpoint export (tests/unit/model/test_consolidate.py)
and of resuming on another plan (Adam's moments: the slow launch of
tests/dist/test_checkpoint_plans.py)."""

from tests.plants.registry import on_result, patched, plant


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


@plant("ckpt_moments_tp_order", "a resume on another plan gets each AutoTP-split parameter's "
       "Adam moments with the writing plan's TP shards joined in reverse order (a merge that "
       "mixes the shards up)", "ckpt_plans")
def _moments_tp_order(rank: int):
    import torch
    from ds_omni.model.tp_files import tp_layout_of
    from ds_omni.train import moments

    def change(found, directory):
        if found is None:
            return found
        layout = tp_layout_of(directory.parent / "model") or {}
        for tensors in found.tensors.values():
            for name, split in layout.items():
                if name in tensors:
                    parts = tensors[name].split(split["sizes"], dim=split["dim"])
                    tensors[name] = torch.cat(parts[::-1], dim=split["dim"])
        return found
    yield from on_result(moments, "read", change)


@plant("ckpt_moments_expert_order", "a resume on another plan gets each MoE layer's "
       "experts' Adam moments in reverse expert order (a stacking that mixes the EP ranks' "
       "experts up)", "ckpt_plans")
def _moments_expert_order(rank: int):
    from ds_omni.train import moments

    def change(found, directory):
        for tensors in (found.tensors.values() if found is not None else []):
            for name in tensors:
                if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    tensors[name] = tensors[name].flip(0)  # [E, ...]
        return found
    yield from on_result(moments, "read", change)

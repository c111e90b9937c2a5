"""The oracle's ranks' side: train through the real DeepSpeed engine and record what the
comparisons need (losses, sample keys, reduced gradients, parameters, the counts that prove a
mechanism ran), in a form `tests/oracle/compare.py` checks against the one-process reference.

Callers import it through `tests/oracle/`; a test that changes how parameters or gradients
are read (AutoEP's expert shards) replaces `full_params` / `full_grads` / `omni_names` here.
"""

from __future__ import annotations

import torch

from tests import plants

def full_params(engine) -> dict[str, torch.Tensor]:
    import deepspeed
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()),
                                           enabled=engine.zero_optimization_stage() == 3):
        return _whole(engine, {n: p.detach().clone().float() for n, p in params.items()})


def _whole(engine, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Under parallel.tp: the backbone's AutoTP shards gathered whole (every rank calls it)."""
    if getattr(engine.module, "tp_counts", None) is None:
        return tensors
    from ds_omni.parallelize.tensor_parallel import gather_tp
    return gather_tp(engine.module, tensors)


def full_grads(engine) -> dict[str, torch.Tensor]:
    """Every trainable parameter's whole reduced gradient (any ZeRO stage); call on all ranks."""
    from deepspeed.utils import safe_get_full_grad
    out = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            g = safe_get_full_grad(p)
            if g is not None:
                out[name] = g.detach().clone().float()
    return _whole(engine, out)


def train_on_rank(rank: int, world: int, cfg, ds_json: dict, steps: int,
                  plant: str | None = None, resume_at: int | None = None,
                  read_params=full_params) -> dict:
    """Train `steps` steps of `cfg` on this rank through the real DeepSpeed engine.

    Returns the losses, every step's sample keys and target counts, counts of micro-batches with
    nothing to encode here, the encoder pool's moved items and "uniform"'s owner broadcasts, the
    SP work (`sp_metrics`, the token shards), the clipping coefficients under ZeRO-0
    (`_ClipWatch`), the eval result after the last step when the config has eval sources, and (on
    rank 0, or data-parallel rank 0 of each pipeline stage, to keep results small) every step's
    reduced gradients and the final parameters. `plant` puts in a known error
    (`tests/plants/`), from before the engine is built: the oracle must see it. `resume_at`:
    save a checkpoint before that step, and after the last step resume from it and train the rest
    again (`_resume_and_rerun`); the final parameters are then the rerun's. `read_params(engine)`
    reads the final parameters (by the engine's names; every rank calls it).
    """
    with plants.applied(plant, rank):  # from the start: some plants change the setup
        return _train(rank, world, cfg, ds_json, steps, resume_at, read_params)


def _train(rank: int, world: int, cfg, ds_json: dict, steps: int, resume_at: int | None,
           read_params) -> dict:
    from ds_omni.train.ds_config import derive_ds_config
    from ds_omni.parallel.plan import ParallelPlan
    from ds_omni.train.loop import pool_metrics
    from ds_omni.train.setup import setup_training
    from ds_omni.train.step import train_step
    plan = ParallelPlan.from_config(cfg.parallel, world, cfg.data.reorder)
    built, loader, engine, groups = setup_training(cfg, derive_ds_config(cfg, ds_json, plan), rank,
                                                   plan)
    # HF's from_pretrained (the model_dir families) hands models over in eval mode
    assert engine.module.training and all(m.training for m in engine.module.modules()), \
        "the trainer must run the model in train mode (dropout on)"
    out = {"losses": [], "keys": [], "nothing_to_encode": 0, "row_without_items": 0,
           "block_rows": 0, "block_rows_with_items": 0, "long_items": 0,
           "optimizer_encoders": _optimizer_encoders(engine, built), "targets": [],
           "shards": [], "sp_rows": 0, "rows_with_items": 0}
    grads, step_params, clip = [], [], _ClipWatch(engine)
    for step in range(steps):
        if step == resume_at:
            _save(cfg, built, engine, loader, step, rank)
        batch = loader.next_step()
        _count_encoder_work(batch, out)
        _record_shards(batch, plan, rank, out)
        out["keys"].append(batch.keys)
        out["targets"].append(sum(mb.num_targets for mb in batch.micro_batches))
        if step > 0:  # the parameters this step's gradients are made at (every rank gathers)
            step_params.append(full_params(engine))
        out["losses"].append(train_step(engine, batch, groups,
                                          lambda e: grads.append(clip.grab(e))).loss)
        out.setdefault("pool_moved", []).append(  # the metric data_pool_moved
            pool_metrics(engine.module).get("data_pool_moved"))
    out["clip_coefs"] = list(clip.coefs)  # a resumed rerun steps on: not its steps
    _record_mechanisms(engine, built, plan, loader, out)
    if cfg.data.eval_sources:  # validation after the last step, on every rank
        from ds_omni.train.evaluate import Evaluator
        out["eval"] = Evaluator(cfg, built, loader, groups).run(engine)
    params = read_params(engine)
    if resume_at is not None:
        out["resumed"] = _resume_and_rerun(cfg, built, engine, loader, groups, resume_at, steps,
                                           rank)
        first, params = params, full_params(engine)
        out["resumed"]["params_differ"] = [n for n, p in params.items()
                                           if not torch.equal(p, first[n])]
    loader.close()
    if rank == 0 or (plan.pp_enabled and plan.coords(rank).dp_rank == 0):  # every stage's own
        names = omni_names(engine, built)
        out.update(grads=[{names[k]: g for k, g in step.items()} for step in grads],
                   step_params=[{names[k]: p for k, p in at.items()} for at in step_params],
                   params={names[k]: p for k, p in params.items()})
    return out


def _record_mechanisms(engine, built, plan, loader, out: dict) -> None:
    """What the mechanisms under test counted over training (read before evaluation runs
    forwards of its own): the loader's reads, AutoTP's layers, the SP work, the pipeline's
    stage boundaries, the joint pipeline's broadcasts and the encoder pool's moved items."""
    import dataclasses
    from ds_omni.parallelize import encoder_pool_of, router_of
    from ds_omni.train.loop import sp_metrics
    counts = getattr(loader, "loader", loader).counts  # what this rank read and decoded
    out["read_counts"] = (counts.rows, counts.bytes, counts.items)
    tp_counts = getattr(engine.module, "tp_counts", None)  # parallel.tp: AutoTP's layers
    if tp_counts is not None:
        out["tp_counts"] = dataclasses.asdict(tp_counts)
        out["local_shapes"] = {n: tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3: unpartitioned
                                for n, p in engine.module.named_parameters()}
        out["layer_windows"] = [getattr(getattr(layer, "self_attn", None), "sliding_window", None)
                                for layer in built.model.backbone.layers]  # None: full
    router = router_of(engine.module)
    if router is not None and router.tp_encoders is not None:  # the encoders' split over TP
        out["tp_encode"] = dataclasses.asdict(router.tp_encoders.counts)
    # the SP work of training (the metrics sp_*; a pipeline stage's is its model's router's)
    out["sp"] = sp_metrics(built.model if plan.pp_enabled else engine.module)
    if out["sp"]:  # Ulysses calls one SP row makes: every decoder layer, again when recomputed
        backbone = built.model.backbone
        calls = len(backbone.layers) * (2 if backbone.checkpoint_layers else 1)
        # under parallel.cp with sp 1 the ring alone runs (no Ulysses); each call passes cp - 1
        out["ulysses_per_row"] = calls if plan.ulysses > 1 or plan.max_sequence_sp > 1 else 0
        if plan.cp_enabled:
            out["ring_per_row"] = calls * (plan.cp - 1)
    if plan.pp_enabled:  # the stage boundaries the engine was built with, its decoder layers
        from ds_omni.parallelize.pipeline import DecoderStage
        out["parts"] = list(engine.module.parts)
        out["stage_layers"] = sum(isinstance(m, DecoderStage) for m in engine.module.modules())
        # deepstack levels this rank's stages added (`pipeline_deepstack`)
        out["deepstack_levels_added"] = engine.module.step_inputs.deep_carry.levels_added
    joint = getattr(engine.module, "joint", None)  # "uniform": the owners' broadcasts issued
    out["encoder_broadcasts"] = joint.shards.broadcasts if joint is not None else 0
    out["items_in_gaps"] = getattr(joint, "items_in_gaps", 0)  # "bubbles": forwards in a gap
    out["bubble_rows_received"] = getattr(joint, "rows_received", 0)  # ... their rows, stage 0
    pool = encoder_pool_of(engine.module)  # items encoded for another rank (a stage's under pp)
    out["pool_items_moved"] = pool.items_moved if pool is not None else 0
    if pool is not None:  # the per-step metric adds up to the items this rank encoded for others
        assert sum(out["pool_moved"]) == pool.items_moved, (out["pool_moved"], pool.items_moved)


class _ClipWatch:
    """Each step's clipping coefficient, seen where it can be: under ZeRO-0 the engine clips
    (DeepSpeed's `clip_grad_norm_`) and then calls the torch optimizer, so the norm of the
    optimizer's gradients before the step's clipping (`grab`) and when the optimizer starts gives
    it. ZeRO-1/2/3 clip inside their optimizer step: no coefficient (`coefs` stays empty)."""

    def __init__(self, engine):
        self.engine, self.coefs, self._before = engine, [], None
        optimizer = engine.optimizer
        if engine.zero_optimization_stage() == 0 and isinstance(optimizer, torch.optim.Optimizer):
            step = optimizer.step
            self.params = [p for g in optimizer.param_groups for p in g["params"]]

            def watched(*args, **kwargs):
                if self._before:
                    self.coefs.append(self._norm() / self._before)
                return step(*args, **kwargs)
            optimizer.step = watched

    def grab(self, engine) -> dict[str, torch.Tensor]:
        """The reduced gradients (`full_grads`), and the norm before clipping."""
        if hasattr(self, "params"):
            self._before = self._norm()
        return full_grads(engine)

    def _norm(self) -> float:
        grads = [p.grad.detach().double() for p in self.params if p.grad is not None]
        return float(torch.sqrt(sum((g * g).sum() for g in grads))) if grads else 0.0


def _save(cfg, built, engine, loader, step: int, rank: int) -> None:
    """A checkpoint as training writes it (with the model/ directory an export needs)."""
    from ds_omni.train import checkpoint
    if rank == 0:
        checkpoint.save_model_meta(checkpoint.checkpoint_root(cfg.train.output_dir), built)
    checkpoint.save(engine, cfg.train.output_dir, step, loader.state_dict(), rank)


def _resume_and_rerun(cfg, built, engine, loader, groups, at: int, steps: int, rank: int) -> dict:
    """Resume from the checkpoint saved before step `at` as `--resume` does (weights, optimizer,
    LR, RNG, data position), train steps `at`.. again and save the final checkpoint; returns the
    rerun's losses and sample keys."""
    from ds_omni.train.loop import resume_from
    from ds_omni.train.step import train_step
    got = {"start": resume_from(engine, loader, cfg.train.output_dir, rank), "losses": [],
           "keys": [], "output_dir": cfg.train.output_dir}
    for _ in range(at, steps):
        batch = loader.next_step()
        got["keys"].append(batch.keys)
        got["losses"].append(train_step(engine, batch, groups).loss)
    _save(cfg, built, engine, loader, steps, rank)
    return got


def _optimizer_encoders(engine, built) -> list[str]:
    """The encoder parameters (OmniModel names) this rank's optimizer holds, read from the
    optimizer itself where its groups hold the parameters (ZeRO-0 fp32: torch's AdamW; ZeRO-1
    holds flat partitions instead, and this is empty)."""
    ours = {id(p): n for n, p in built.model.named_parameters()}
    groups = getattr(engine.optimizer, "param_groups", None) or []
    return sorted(ours[id(p)] for g in groups for p in g["params"]
                  if ours.get(id(p), "").startswith("encoders."))


def omni_names(engine, built) -> dict[str, str]:
    """The engine module's parameter names -> the OmniModel's (a pipeline stage names them by
    layer index), found by tensor identity."""
    ours = {id(p): n for n, p in built.model.named_parameters()}
    return {n: ours[id(p)] for n, p in engine.module.named_parameters()}


def _record_shards(batch, plan, rank: int, out: dict) -> None:
    """Each micro-batch's tokens on this rank, with the SP group the plan splits its row over
    ((first rank, size); static SP: every row over the rank's group, per-sequence SP: a long
    sequence's row over its block) and the whole padded row's length; no group: a row run
    whole. Taken from the plan and the loader, not from the model, so a row the model runs
    whole under SP still counts as split."""
    # the group's first rank (its SP ranks are tp apart: consecutive without tp)
    static = (rank - plan.coords(rank).sp_rank * plan.tp, plan.sp) if plan.sp > 1 else None
    for i, mb in enumerate(batch.micro_batches):
        group = mb.route.sp_block or static
        out["shards"].append((len(out["keys"]), i, group, mb.input_ids[0].tolist(),
                              int(mb.cu_seqlens[-1]),
                              {"real": mb.num_tokens,
                               "positions": mb.position_ids.reshape(-1).tolist(),
                               "slots": _ring_slots(mb, plan, rank)}))
        out["sp_rows"] += group is not None
        out["rows_with_items"] += bool(mb.route.reshard is not None and mb.route.reshard.group_rows)


def _ring_slots(mb, plan, rank: int) -> list[int]:
    """Under parallel.cp: the row positions of this rank's tokens (its slice of the zigzag
    layout the loader cut the row by); empty otherwise."""
    index = mb.route.row_index
    if index is None:
        return []
    s = mb.input_ids.shape[1]
    c = plan.coords(rank)  # a per-sequence block's row: the rank's place in its block
    lo = (c.dp_rank - mb.route.sp_block[0] if mb.route.sp_block else c.sp_rank) * s
    return index.reshape(-1)[lo:lo + s].tolist()


def _count_encoder_work(batch, out: dict) -> None:
    for mb in batch.micro_batches:
        out["nothing_to_encode"] += not mb.encoder_inputs
        route = mb.route
        out["row_without_items"] += bool(route.reshard is not None and not route.reshard.group_rows)
        out["block_rows"] += route.sp_block is not None
        out["block_rows_with_items"] += bool(route.sp_block is not None and route.reshard.group_rows)
        # items the whole SP group encoded, each rank its piece (long-short SP)
        out["long_items"] += sum(map(len, route.reshard.split.values())) if route.reshard else 0

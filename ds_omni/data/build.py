"""Config + model -> the loader of one data-parallel rank (sources, processors, cost model)."""

from __future__ import annotations

import logging

from ds_omni.config import OmniConfig
from ds_omni.data.cores import trainer_plan
from ds_omni.data.cost import CostModel, ModelDims
from ds_omni.data.loader import OmniLoader
from ds_omni.data.loader_process import LoaderParts, LoaderProcess
from ds_omni.data.media import video_decoder
from ds_omni.data.processing import SampleProcessor
from ds_omni.data.rank_place import (DataComm, LoaderComms, LongSplits, RankPlace, ShardComm,
                                     SharedReading)
from ds_omni.data.workers import resolve_workers
from ds_omni.data.templates import training_template
from ds_omni.errors import ConfigError
from ds_omni.parallel.long_short import LongItems
from ds_omni.parallel.plan import ParallelPlan, reorder_group_size

log = logging.getLogger(__name__)


def cost_model_for(built, freeze: list[str], scales: dict[str, float] | None = None) -> CostModel:
    """FLOP-based cost model of the built model (frozen encoders cost a forward pass only),
    with measured per-term scales when calibrated."""
    dims = ModelDims.from_hf_config(built.hf_config)
    for name, enc in dims.encoders.items():
        enc.frozen = name in freeze
    try:
        return CostModel(dims, scales=scales)
    except ValueError as e:
        raise ConfigError(f"data.reorder.cost_scales: {e}") from None


def item_processors(cfg: OmniConfig, built, sources) -> dict:
    """The model's item processors, the video one sampling frames as `data.video` says. With a
    video column in `sources`, a model without videos or a missing decoder is an error now, not
    at the first video."""
    procs = dict(built.item_processors)
    if hasattr(procs.get("video"), "with_options"):
        procs["video"] = procs["video"].with_options(cfg.data.video)
    with_video = [s.name for s in sources if s.schema.video]
    if with_video and "video" not in procs:
        raise ConfigError(f"data sources {with_video} have a schema.video column but this model "
                          f"({built.family.name}) takes no videos; set their schema.video to null, "
                          "or train a family that does (qwen2_vl, qwen2_5_vl)")
    if with_video:
        video_decoder()
    return procs


def sample_processors(cfg: OmniConfig, built, sources=None) -> dict[str, SampleProcessor]:
    """One sample processor per source (sources may mark images and audio differently);
    `sources` defaults to data.sources (data.eval_sources for validation)."""
    template = training_template(cfg.data.template, built)
    sources = cfg.data.sources if sources is None else sources
    procs = item_processors(cfg, built, sources)
    return {s.name: SampleProcessor(
        tokenizer=built.tokenizer, family=built.family, item_processors=procs,
        markers=s.schema.markers(),
        max_seq_len=cfg.data.max_seq_len, overlong=cfg.data.overlong,
        conversation_strings=s.schema.conversation_strings, image_aspect=cfg.data.image_aspect,
        template=template, max_image_pixels=cfg.data.max_image_pixels) for s in sources}


def build_loader(cfg: OmniConfig, built, *, dp_rank: int, dp_size: int, num_micro: int,
                 comm: DataComm | None = None, sp_rank: int = 0, sp_size: int = 1,
                 step_comm: DataComm | None = None, cost: CostModel | None = None,
                 long_items: LongItems | None = None,
                 reorder_group: int | None = None,
                 shard_comm: ShardComm | None = None, plan: ParallelPlan | None = None,
                 rank: int = 0, timeout_s: float = 1800.0) -> OmniLoader | LoaderProcess:
    """The loader of one data-parallel rank; under SP (sp_size > 1) it packs shard `sp_rank`.
    `step_comm`: other groups for the all-gathers of its steps (a prefetch thread runs them).
    A run's composition root (`ds_omni.train.setup`) passes the cost model, the long items and
    the plan's reorder group it built once; a loader built alone (a tool, a test) derives its own
    (None). `shard_comm`: the collective of the ranks that train on this rank's rows (its sp x
    tp ranks), for one reader among them (`data.shared_reading`; None: each reads them itself).

    `data.workers` >= 1: the loader runs in a process of its own (`loader_process.py`), which
    rebuilds its groups from `plan` as global rank `rank` (`timeout_s`: how long the trainer
    waits for it); `comm` stays the trainer's; `data.pin_cores` places the processes on cores."""
    parts = loader_parts(cfg, built, dp_rank=dp_rank, dp_size=dp_size, num_micro=num_micro,
                         sp_rank=sp_rank, sp_size=sp_size, cost=cost, long_items=long_items,
                         reorder_group=reorder_group)
    workers = resolve_workers(cfg.data.workers)
    if workers >= 1:
        # one reader per sp x tp group: its collective is the loader processes' own
        shared = (_reading(cfg, None) if cfg.data.shared_reading and sp_size * cfg.parallel.tp > 1
                  else None)
        return LoaderProcess(parts, workers, comm=comm, plan=plan, rank=rank, timeout_s=timeout_s,
                             shared=shared, cores=trainer_plan(cfg.data.pin_cores, workers))
    return parts.build(LoaderComms(comm, step_comm, shared_reading(cfg, shard_comm)), 0)


def loader_parts(cfg: OmniConfig, built, *, dp_rank: int, dp_size: int, num_micro: int,
                 sp_rank: int = 0, sp_size: int = 1, cost: CostModel | None = None,
                 long_items: LongItems | None = None,
                 reorder_group: int | None = None) -> LoaderParts:
    """What the loader of one data-parallel rank is built from (picklable)."""
    if cost is None:
        cost = cost_model_for(built, cfg.model.frozen_parts(), cfg.data.reorder.cost_scales)
    processors = sample_processors(cfg, built)
    if long_items is None:  # (where long-short SP is off this finds None again)
        long_items = long_items_of(cfg, built.model, max(sp_size, cfg.parallel.max_sequence_sp))
    if reorder_group is None:
        reorder_group = reorder_group_size(cfg.data.reorder, dp_size)
    place = RankPlace(dp_rank=dp_rank, dp_size=dp_size, num_micro=num_micro,
                      reorder_group=reorder_group, sp_rank=sp_rank, sp_size=sp_size)
    return LoaderParts(cfg.data, processors, cost, cfg.train.global_batch_size, place,
                       LongSplits(cfg.parallel.max_sequence_sp, long_items))


def shared_reading(cfg: OmniConfig, comm: ShardComm | None) -> SharedReading | None:
    """One reader per sp x tp group where the config asks for it and the group has its collective.
    The encoder pool and the joint pipeline read other items' inputs on every rank of a row's
    group: its peers then get every item whole."""
    if comm is None or not cfg.data.shared_reading:
        return None
    return _reading(cfg, comm)


def _reading(cfg: OmniConfig, comm: ShardComm | None) -> SharedReading:
    """How a reader group shares its rows, over `comm`."""
    return SharedReading(comm, all_items=cfg.parallel.encoder_pool != "off" or cfg.parallel.pp > 1,
                         tp_apart=cfg.parallel.tp if cfg.parallel.tp_encodes_apart else 1)


def long_items_of(cfg: OmniConfig, model, group: int) -> LongItems | None:
    """Which items a group of ranks sharing a row encodes together (`parallel.encoder_sp`); an
    encoder whose heads don't split over the group keeps its long items whole (said once)."""
    if cfg.parallel.encoder_sp == "off" or group < 2:
        return None
    heads = {name: h for name, enc in model.encoders.items() if (h := enc.attention_heads())}
    for name, enc in model.encoders.items():
        if name not in heads:
            log.info("long-short SP: the %s encoder (%s) cannot encode a piece of an item; its "
                     "long items run whole on one rank", name, type(enc.tower).__name__)
        elif heads[name] % group:
            log.info("long-short SP: the %s encoder has %d attention heads, which groups of %d "
                     "ranks cannot split; its long items run whole on one rank there",
                     name, heads[name], group)
    threshold = None if cfg.parallel.encoder_sp == "auto" else float(cfg.parallel.encoder_sp)
    return LongItems(threshold, heads)

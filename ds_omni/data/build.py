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
from ds_omni.data.rank_place import (LoaderComms, LongSplits, RankPlace, ShardComm,
                                     SharedReading)
from ds_omni.data.workers import resolve_workers
from ds_omni.data.templates import training_template
from ds_omni.errors import ConfigError
from ds_omni.parallel import dist
from ds_omni.parallel.long_short import LongItems
from ds_omni.parallel.groups import RankGroups
from ds_omni.parallel.plan import ParallelPlan

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


def build_loader(cfg: OmniConfig, built, plan: ParallelPlan | None = None,
                 groups: RankGroups | None = None, *, num_micro: int,
                 cost: CostModel | None = None) -> OmniLoader | LoaderProcess:
    """The loader of rank `groups.rank` of `plan` (None: one rank alone) over `groups`, its
    collectives (None: `RankGroups.alone()`, it talks to no other rank); `num_micro`
    micro-batches a step. `cost`: the run's one cost model (None: its own).

    `data.workers` >= 1: the loader runs in a process of its own (`loader_process.py`), which
    rebuilds its groups from the plan (the trainer waits for it `dist.timeout_s()`); the
    trainer keeps `groups.comm`; `data.pin_cores` places the processes on cores."""
    groups = groups or RankGroups.alone()
    place = RankPlace(plan=plan or ParallelPlan(world_size=1, dp=1), rank=groups.rank,
                      num_micro=num_micro)
    parts = loader_parts(cfg, built, place, cost)
    workers = resolve_workers(cfg.data.workers)
    if workers >= 1:
        # one reader per sp x tp group: its collective is the loader processes' own
        shared = (_reading(cfg, place.plan, None)
                  if cfg.data.shared_reading and place.plan.reader_group_size > 1 else None)
        return LoaderProcess(parts, workers, comm=groups.comm, timeout_s=dist.timeout_s(),
                             shared=shared, cores=trainer_plan(cfg.data.pin_cores, workers))
    comms = LoaderComms(groups.comm, groups.step_comm,
                        shared_reading(cfg, place.plan, groups.shard_comm))
    return parts.build(comms, 0)


def loader_parts(cfg: OmniConfig, built, place: RankPlace,
                 cost: CostModel | None = None) -> LoaderParts:
    """What the loader of one rank is built from (picklable)."""
    if cost is None:
        cost = cost_model_for(built, cfg.model.frozen_parts(), cfg.data.reorder.cost_scales)
    long_items = long_items_of(cfg, built.model, place.plan.long_item_group)
    return LoaderParts(cfg.data, sample_processors(cfg, built), cost, cfg.train.global_batch_size,
                       place, LongSplits(long_items))


def shared_reading(cfg: OmniConfig, plan: ParallelPlan,
                   comm: ShardComm | None) -> SharedReading | None:
    """One reader per sp x tp group where the config asks for it and the group has its collective.
    The encoder pool and the joint pipeline read other items' inputs on every rank of a row's
    group: its peers then get every item whole."""
    if comm is None or not cfg.data.shared_reading:
        return None
    return _reading(cfg, plan, comm)


def _reading(cfg: OmniConfig, plan: ParallelPlan, comm: ShardComm | None) -> SharedReading:
    """How a reader group shares its rows, over `comm`."""
    return SharedReading(comm, all_items=plan.encoder_pool or plan.pp_enabled,
                         tp_apart=plan.tp if plan.tp_encodes_apart else 1)


def long_items_of(cfg: OmniConfig, model, group: int) -> LongItems | None:
    """Which items a group of ranks sharing a row encodes together (`parallel.encoder_sp`); an
    encoder whose heads don't split over the group keeps its long items whole (said once)."""
    if cfg.parallel.encoder_sp == "off" or group < 2:
        return None
    if cfg.parallel.pp > 1 and cfg.parallel.encoder_placement != "stage0":
        # the joint pipeline's stages encode whole items (`parallelize.joint.EncodeShare`)
        log.info("long-short SP: off under the joint pipeline (encoder_placement \"%s\"), "
                 "whose stages share the items whole", cfg.parallel.encoder_placement)
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

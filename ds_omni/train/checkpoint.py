"""Checkpoints: DeepSpeed's engine state plus what ds_omni owns, and resuming from them.

Under `<output_dir>/checkpoints/`: `latest` (the newest complete tag, moved last), `model/` (HF
config, tokenizer, processor: enough to export), `.stepN.tmp/` (a save in progress, never
loaded) and `stepN/` with DeepSpeed's files, `manifest.json` (size and sha256 of every file,
written last: `--resume` checks it and falls back to the newest that passes),
`loader_state.json`, `rng_rank{r}.pt` and `trainer_state.json` (the step, the run's id that
`--resume` follows, and `run_fingerprint`, so resuming another model or layout says what
differs before DeepSpeed reads a byte). On another number of ranks, `load` converts once with
DeepSpeed's `ds_to_universal` into `universal/` and loads it re-partitioned (bit-equal fp32
weights and Adam moments, measured); the data position is elastic. On another pp, tp or ep
(or a pipeline on another number of ranks) `ds_omni.train.reshard` consolidates the weights
and the whole moments each save adds (`ds_omni.train.moments`). DeepSpeed's files are
pickles: load only checkpoints you wrote.
More: docs/fault_tolerance.md.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import shutil
from argparse import Namespace
from pathlib import Path

import torch
import torch.distributed as dist

from ds_omni.errors import LaunchError
from ds_omni.model.convert import MODEL_META_DIR
from ds_omni.model.tp_files import save_tp_layout
from ds_omni.parallel.dist import barrier
from ds_omni.parallelize.tensor_parallel import tp_layout
from ds_omni.train import moments, runs
from ds_omni.train.fingerprint import (RESTART_FROM_HF, check_model_parallel,
                                       fingerprint_differences, run_fingerprint)
from ds_omni.train.rng import rng_state, set_rng_state

CHECKPOINT_DIR = "checkpoints"
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
TAG_RE = re.compile(r"step\d{8}")
UNIVERSAL_DIR = "universal"
# DeepSpeed's optimizer shards: ZeRO 1-2 and bf16 ("bf16_zero_pp_rank_R_..."), ZeRO-3 also
# ("zero_pp_rank_R_mp_rank_00_optim_states.pt"); one per rank that wrote the checkpoint
_SHARD_RE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINT_DIR


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def check_writable(directory: str | Path) -> None:
    """Fail at start-up, naming the path, if the output directory cannot be written."""
    p = Path(directory)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise LaunchError(f"output directory {str(p)!r} is not writable ({e.strerror or e}); set "
                          "train.output_dir to a directory you can write") from None


def save_model_meta(root: Path, built) -> None:
    """HF config + tokenizer + processor, so a checkpoint can be exported on its own."""
    meta = root / MODEL_META_DIR
    meta.mkdir(parents=True, exist_ok=True)
    built.hf_config.save_pretrained(str(meta))
    built.family.save_processor(meta, built.hf_config, built.tokenizer, built.model_dir)
    from ds_omni.model.lora import save_meta
    save_meta(built.model, meta)  # LoRA: which layers carry adapters, how to export
    if getattr(built.model, "tp_counts", None) is not None:  # parallel.tp: how to make it whole
        save_tp_layout(meta, tp_layout(built.model))


def save(engine, output_dir: str | Path, step: int, loader_state: dict, rank: int,
         keep: int = 0, whole_moments: bool = True) -> Path:
    """Write a complete checkpoint for `step` (every rank calls this), so that a crash at any
    moment leaves the previous one usable.

    Every file goes into `.<tag>.tmp/`; when all ranks have written and fsynced theirs, rank 0
    adds `manifest.json` (size and sha256 of every file), renames the directory to `<tag>` and
    only then moves `latest` (write, fsync, rename). `keep` > 0 removes all but the newest `keep`;
    `whole_moments`: Adam's moments whole too (`ds_omni.train.moments`).
    """
    root = checkpoint_root(output_dir)
    tag = tag_for(step)
    tmp = root / f".{tag}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
        tmp.mkdir(parents=True)
    barrier()
    try:
        _write_files(engine, root, tmp, step, loader_state, rank, whole_moments)
    except (OSError, RuntimeError) as e:
        if not disk_full(e):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # not left holding the space
        raise LaunchError(f"no space left on device at {str(root)!r}; the checkpoint needs about "
                          f"{_needed_mb(engine, root)} MB. Free space there (or lower "
                          "train.keep_checkpoints), or set train.output_dir to a disk with room, "
                          "then --resume from the last complete checkpoint") from None
    barrier()
    digests = _digest_share(tmp, rank)  # each rank hashes and fsyncs a share of the files
    if rank == 0:
        files = {k: v for part in digests for k, v in part.items()}
        _write_durably(tmp / MANIFEST, json.dumps(
            {"version": MANIFEST_VERSION, "step": step, "files": files}, indent=1))
        _publish(root, tmp, tag)
        _write_latest(root, tag)
        if keep:
            prune(root, keep, upto=tag)
    barrier()
    return root / tag


def _write_files(engine, root: Path, tmp: Path, step: int, loader_state: dict,
                 rank: int, whole_moments: bool) -> None:
    """This rank's files of a checkpoint into `tmp`: RNG, (rank 0) the data position and the
    trainer state, DeepSpeed's own, and (a stage's first rank) its whole moments."""
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        (tmp / "loader_state.json").write_text(json.dumps(loader_state, indent=1))
        (tmp / "trainer_state.json").write_text(json.dumps(
            {"step": step, "run": run_fingerprint(engine), "run_id": runs.run_of(root)}))
    engine.save_checkpoint(str(root), tag=tmp.name, save_latest=False)
    if whole_moments:  # Adam's moments whole, for a resume on another plan
        moments.save(engine, tmp, rank)


def disk_full(error: BaseException) -> bool:
    """An OSError ENOSPC, or torch's serializer failing on a full disk ("unexpected pos",
    "file write failed")."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(error)
    return any(s in text for s in ("unexpected pos", "file write failed", "No space left"))


def _needed_mb(engine, root: Path) -> int:
    """The size of the newest complete checkpoint, or, if none, 24 bytes a parameter (fp32
    weights and Adam's two moments, the model's own copy, the moments whole once more)."""
    for tag in step_tags(root):
        if (root / tag / MANIFEST).is_file():
            files = json.loads((root / tag / MANIFEST).read_text())["files"]
            return max(1, round(sum(size for size, _ in files.values()) / 2 ** 20))
    return max(1, round(sum(p.numel() for p in engine.module.parameters()) * 24 / 2 ** 20))


def _digest_share(directory: Path, rank: int) -> list[dict]:
    """{relative path: [size, sha256]} of every file, hashed (and fsynced) by the ranks in turns."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    mine = {}
    for path in files[rank::world]:
        mine[str(path.relative_to(directory))] = [path.stat().st_size, _sha256(path, sync=True)]
    if world == 1:
        return [mine]
    out = [None] * world
    dist.all_gather_object(out, mine)
    return out


def _sha256(path: Path, sync: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(root: Path, tmp: Path, tag: str) -> None:
    """The finished directory takes its name (an older save of the same step steps aside)."""
    _fsync_dir(tmp)
    final, old = root / tag, root / f".{tag}.old"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def _write_latest(root: Path, tag: str) -> None:
    _write_durably(root / "latest.tmp", tag)
    os.replace(root / "latest.tmp", root / "latest")
    _fsync_dir(root)


def prune(root: Path, keep: int, upto: str) -> list[str]:
    """Remove all but the newest `keep` step directories up to `upto` (the one just written), and
    leftovers of crashed saves. Newer ones (passed over at a resume) are left for inspection."""
    tags = sorted(p.name for p in root.iterdir()
                  if p.is_dir() and TAG_RE.fullmatch(p.name) and p.name <= upto)
    doomed = tags[:-keep] + [p.name for p in root.iterdir()
                             if p.name.startswith(".step") and p.name.endswith((".tmp", ".old"))]
    for name in doomed:
        shutil.rmtree(root / name, ignore_errors=True)
    return doomed


def latest_tag(output_dir: str | Path) -> str | None:
    latest = checkpoint_root(output_dir) / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def check_complete(directory: Path, legacy_ok: bool = False) -> str | None:
    """Why the checkpoint in `directory` cannot be used, or None if its manifest checks out."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        if legacy_ok and (directory / "trainer_state.json").is_file():
            return None  # written before manifests, and named by `latest`: whole by construction
        return "no manifest.json (its save did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        return f"manifest.json is unreadable ({e})"
    for name, (size, digest) in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
        if _sha256(path) != digest:
            return f"{name} fails its sha256 checksum (the file is corrupted)"
    return None


def step_tags(root: Path) -> list[str]:
    """The step directories under `root`, newest first (complete or not)."""
    return sorted((p.name for p in root.iterdir() if p.is_dir() and TAG_RE.fullmatch(p.name)),
                  reverse=True) if root.is_dir() else []


def newest_complete(root: Path) -> tuple[str | None, list[str]]:
    """(tag of the newest usable checkpoint or None, why each newer one was passed over)."""
    latest, run = latest_tag(root.parent), runs.current_run(root)
    skipped = []
    for tag in step_tags(root):
        problem = (runs.same_run(run, root / tag)
                   or check_complete(root / tag, legacy_ok=tag == latest))
        if problem is None:
            return tag, skipped
        skipped.append(f"{tag}: {problem}")
    return None, skipped


def _finished(output_dir: str | Path) -> list[str]:
    """Step directories whose save finished (a manifest, or the legacy one `latest` names),
    newest first; no checksums."""
    root, latest = checkpoint_root(output_dir), latest_tag(output_dir)
    return [t for t in step_tags(root) if (root / t / MANIFEST).is_file() or (
        t == latest and (root / t / "trainer_state.json").is_file())]


def check_resumable(output_dir: str | Path) -> None:
    """Before any process group or model exists: --resume with no finished save at all (no step
    directory with a manifest) is an error now, not after the model is built and DeepSpeed
    started. Cheap (no checksums, every rank may call it): `load` verifies the files."""
    if not _finished(output_dir):
        root = checkpoint_root(output_dir)
        raise _nothing_to_resume(root, [f"{t}: no manifest.json (its save did not finish)"
                                        for t in step_tags(root)])


def check_fresh_start(output_dir: str | Path, overwrite: bool) -> None:
    """A run started without --resume into a folder that holds a run's checkpoints would
    overwrite them: refused (every rank, at start-up) unless train.overwrite_output_dir."""
    done = _finished(output_dir)
    if done and not overwrite:
        raise LaunchError(
            f"train.output_dir {str(output_dir)!r} already holds the checkpoints of a run "
            f"(newest: {done[0]}, step {int(done[0][4:])}); starting without --resume would "
            "overwrite them. Pass --resume to continue that run, set train.output_dir to "
            "another folder for a new run, or set train.overwrite_output_dir: true to start a "
            "new run here (--resume then passes the earlier run's checkpoints over)")


def start_run(output_dir: str | Path) -> str:
    """A run started without --resume (rank 0): a new run id, and `latest` (which names the
    earlier run's checkpoint, if any) removed."""
    root = checkpoint_root(output_dir)
    (root / "latest").unlink(missing_ok=True)
    return runs.set_run(root)


def _nothing_to_resume(root: Path, skipped: list[str]) -> LaunchError:
    if not skipped:
        return LaunchError(f"--resume: no checkpoint in {str(root)!r}; start without --resume "
                           "or point train.output_dir at the earlier run")
    return LaunchError(f"--resume: no complete checkpoint in {str(root)!r}: " + "; ".join(skipped))


def load(engine, output_dir: str | Path, rank: int, resharded: bool = False) -> tuple[int, dict]:
    """Restore the newest complete checkpoint; returns (step, loader state). Rank 0 checks the
    manifests (newest first) and every rank loads the one it picks; a newer one that is
    incomplete or corrupted is reported and passed over. `resharded`: another plan's, its
    weights already in the engine (`ds_omni.train.reshard`)."""
    root = checkpoint_root(output_dir)
    choice = [newest_complete(root) if rank == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    tag, skipped = choice[0]
    if rank == 0:
        for note in skipped:
            print(f"ds-omni: --resume: passing over checkpoint {note}")
    if tag is None:
        raise _nothing_to_resume(root, skipped)
    trainer_state = read_json(root / tag / "trainer_state.json")
    if rank == 0:
        run = runs.set_run(root, trainer_state.get("run_id") or runs.current_run(root))
        print(f"ds-omni: --resume: resuming run {run} from {str(root / tag)!r} (step "
              f"{trainer_state.get('step')})", flush=True)
    if resharded:
        return _load_resharded(engine, root / tag, trainer_state)
    now = run_fingerprint(engine)
    check_model_parallel(trainer_state.get("run"), now, root / tag)
    problems = fingerprint_differences(trainer_state.get("run"), now)
    if problems:
        raise LaunchError(f"--resume: checkpoint {str(root / tag)!r} was written by a different "
                          "run: " + "; ".join(problems) + ". Resume with the model and DeepSpeed "
                          "config it was written with, or set train.output_dir to a new "
                          "directory to start afresh")
    loader_state = read_json(root / tag / "loader_state.json")
    world = dist.get_world_size() if dist.is_initialized() else 1
    saved_ranks = shard_ranks(root / tag)
    universal = resharding_needed(saved_ranks, world)
    if universal and hasattr(engine.module, "whole_model_shapes"):  # a pipeline stage
        raise LaunchError(f"--resume: {saved_ranks} rank(s) wrote the pipeline checkpoint {tag}, "
                          f"this run has {world}; DeepSpeed's loading cannot re-partition a "
                          "pipeline checkpoint (parallel.pp > 1): resume it with `ds-omni train "
                          "--resume`, which consolidates it first (ds_omni.train.reshard)")
    if universal and (now["tp"] > 1 or now["ep"] > 1):
        raise LaunchError(f"--resume: {saved_ranks} rank(s) wrote {tag}, this run has {world}; "
                          f"a checkpoint written under parallel.tp={now['tp']} / parallel.ep="
                          f"{now['ep']} resumes on the number of ranks that wrote it only "
                          "(ds_omni's universal-checkpoint path re-partitions ZeRO's shards "
                          "only, not AutoTP's or AutoEP's). " + RESTART_FROM_HF.format(root=root))
    if universal and rank == 0:
        print(f"ds-omni: --resume: {saved_ranks} rank(s) wrote {tag}, this run has {world}: "
              "loading it as a universal checkpoint (optimizer state re-partitioned)", flush=True)
    load_tag = universal_tag(root, tag, rank) if universal else tag
    path = _engine_load(engine, root, load_tag, universal)
    if path is None:
        raise LaunchError(f"--resume: DeepSpeed could not load checkpoint {str(root / tag)!r}")
    scheduler = engine.lr_scheduler
    if getattr(scheduler, "last_batch_iteration", -1) >= 0:  # the LR of the step that runs next
        scheduler.step(scheduler.last_batch_iteration)
    step = trainer_state["step"]
    rng_file = root / tag / f"rng_rank{rank}.pt"
    if rng_file.exists():  # absent when resuming on more ranks than wrote the checkpoint
        set_rng_state(torch.load(rng_file, weights_only=True))
    return step, loader_state


def _load_resharded(engine, directory: Path, trainer_state: dict) -> tuple[int, dict]:
    """A checkpoint of another plan: the model family checked, the engine's step and sample
    counts and the LR schedule restored (the weights came in whole before the plan sharded
    them; the RNG streams of ranks with other roles are not carried over)."""
    saved, now = trainer_state.get("run") or {}, run_fingerprint(engine)
    if saved.get("family", now["family"]) != now["family"]:
        raise LaunchError(f"--resume: checkpoint {str(directory)!r} holds a "
                          f"{saved['family']!r} model, this run trains {now['family']!r}; "
                          "resume with the model it was written with")
    states = torch.load(directory / "mp_rank_00_model_states.pt", map_location="cpu",
                        weights_only=False)
    engine.global_steps = states.get("global_steps", engine.global_steps)
    engine.global_samples = states.get("global_samples", engine.global_samples)
    scheduler = engine.lr_scheduler
    if scheduler is not None and states.get("lr_scheduler") is not None:
        scheduler.load_state_dict(states["lr_scheduler"])
    if getattr(scheduler, "last_batch_iteration", -1) >= 0:  # the LR of the step that runs next
        scheduler.step(scheduler.last_batch_iteration)
    return trainer_state["step"], read_json(directory / "loader_state.json")


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LaunchError(f"--resume: {str(path)!r} cannot be read ({e}); the checkpoint is "
                          f"damaged: move {path.parent.name} out of {str(path.parent.parent)!r} "
                          "to resume from the one before it") from None
    if not isinstance(value, dict):
        raise LaunchError(f"--resume: {str(path)!r} holds {type(value).__name__}, not an object; "
                          f"the checkpoint is damaged: move {path.parent.name} aside to resume "
                          "from the one before it")
    return value


def shard_ranks(directory: Path) -> int:
    """How many ranks wrote the optimizer shards in a DeepSpeed checkpoint directory (0: its
    optimizer state is whole, in the model states file: no ZeRO, fp32). A shard is named by its
    data-parallel rank and its model-parallel rank (a pipeline stage), so the ranks are the
    distinct pairs: a pipeline of 2 stages on 2 ranks writes `zero_pp_rank_0_mp_rank_00` and
    `zero_pp_rank_0_mp_rank_01`."""
    return len({m.groups() for p in directory.glob("*optim_states.pt")
                if (m := _SHARD_RE.fullmatch(p.name))})


def resharding_needed(saved_ranks: int, world: int) -> bool:
    """A checkpoint whose optimizer is sharded for another number of ranks loads only through a
    universal checkpoint (DeepSpeed's own loading would fail or mis-assign the shards)."""
    return saved_ranks > 0 and saved_ranks != world


def universal_tag(root: Path, tag: str, rank: int) -> str:
    """`<tag>/universal`, converted by rank 0 if no earlier resume did (every rank calls this;
    a failed conversion raises on every rank, not only on rank 0)."""
    target = root / tag / UNIVERSAL_DIR
    problem = [None]
    if rank == 0 and not target.is_dir():
        try:
            to_universal(root / tag, target)
        except LaunchError as e:
            problem[0] = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise LaunchError(problem[0])
    return f"{tag}/{UNIVERSAL_DIR}"


def to_universal(directory: Path, target: Path) -> None:
    """DeepSpeed's `ds_to_universal` of one checkpoint directory, into a temporary folder that
    takes its name when complete (a crash mid-way leaves nothing a later resume would use)."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
    tmp = directory / f".{target.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    args = Namespace(input_folder=str(directory), output_folder=str(tmp), num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True,
                     inject_missing_state=True)  # ds_omni is not Megatron: no client info
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):  # its progress
            ds_to_universal(args)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise LaunchError(f"--resume: converting {str(directory)!r} to a universal checkpoint "
                          f"(to load it on another number of ranks) failed: {type(e).__name__}: "
                          f"{e}. Resume with the number of ranks that wrote it "
                          f"({shard_ranks(directory)})") from None
    (directory / "latest_universal").unlink(missing_ok=True)  # names the temporary folder
    _fsync_dir(tmp)
    os.replace(tmp, target)
    _fsync_dir(directory)


def _engine_load(engine, root: Path, tag: str, universal: bool):
    """DeepSpeed's load; `universal` switches the engine's universal loading on for this load
    only (the engine reads it from its config at load time)."""
    config = getattr(engine, "_config", None)
    before = getattr(config, "load_universal_checkpoint", False)
    if config is not None:
        config.load_universal_checkpoint = universal
    try:
        path, _ = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
    finally:
        if config is not None:
            config.load_universal_checkpoint = before
    return path

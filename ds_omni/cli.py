"""`ds-omni` command line: parse, build a config, call one function.

    ds-omni train   --config examples/tiny_llava.json --deepspeed ds_configs/zero2.json [--resume]
    ds-omni supervise --max-restarts 3 --backoff 10 -- deepspeed --num_gpus 2 --module ds_omni train ...
    ds-omni convert --checkpoint outputs/run/checkpoints --out outputs/run/hf
    ds-omni plan    --config examples/tiny_llava.json --deepspeed ds_configs/zero2.json --world-size 8
    ds-omni calibrate-cost --config examples/tiny_llava.json --out cost_scales.json
    ds-omni data make-demo --out data/shapes
    ds-omni data check --config my.json [--sample 1000] [--json]

Launch `train` with any launcher: `deepspeed --num_gpus 2 --module ds_omni train ...`,
`torchrun --nproc_per_node 2 -m ds_omni train ...`, `accelerate launch -m ds_omni train ...`, or
plain `ds-omni train ...` for one process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ds_omni.errors import DsOmniError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-omni", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model")
    t.add_argument("--config", required=True, help="ds_omni JSON config")
    t.add_argument("--deepspeed", help="DeepSpeed JSON config (default: the one accelerate passes)")
    t.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    t.add_argument("--stop-after", type=int, help="stop (with a checkpoint) after N steps of this run")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set train.steps=10 (JSON value)")

    sv = sub.add_parser("supervise", help="run a training command; after a failure, restart it "
                                          "from its newest complete checkpoint")
    sv.add_argument("--max-restarts", type=int, default=3, help="restarts before giving up")
    sv.add_argument("--backoff", type=float, default=10.0,
                    help="seconds before the first restart, doubling for each next one")
    sv.add_argument("--output-dir", help="the run's train.output_dir (default: read from the "
                                         "command's --config and --set)")
    sv.add_argument("run_command", nargs=argparse.REMAINDER, metavar="command",
                    help="-- then the training command, e.g. -- deepspeed --num_gpus 8 --module "
                         "ds_omni train --config my.json --deepspeed ds_configs/zero2.json")

    c = sub.add_parser("convert", help="convert between HF directories, OmniModel directories "
                                          "and training checkpoints")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="<output_dir>/checkpoints of a run (any ZeRO stage) -> HF")
    src.add_argument("--hf", help="an HF MLLM directory -> an OmniModel directory")
    src.add_argument("--omni", help="an OmniModel directory -> an HF directory")
    c.add_argument("--tag", help="checkpoint tag (default: latest)")
    c.add_argument("--out", required=True, help="output directory")

    pl = sub.add_parser("plan", help="print the parallel plan, its rank layout and the derived "
                                     "DeepSpeed config")
    pl.add_argument("--config", required=True)
    pl.add_argument("--deepspeed", required=True)
    pl.add_argument("--world-size", type=int, required=True)
    pl.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")

    cc = sub.add_parser("calibrate-cost", help="time micro-batches on this machine and fit the "
                                               "cost model's scales (data.reorder.cost_scales)")
    cc.add_argument("--config", required=True)
    cc.add_argument("--batches", type=int, default=30)
    cc.add_argument("--out", required=True, help="JSON file for the fitted scales")
    cc.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")

    fm = sub.add_parser("families", help="which transformers vision-language model types ds_omni "
                                         "trains exactly (builds a tiny model of each and checks "
                                         "it against HF)")
    fm.add_argument("--json", action="store_true",
                    help='print {model_type: {"supported": bool, "reason": str}}')
    fm.add_argument("model_types", nargs="*", help="only these model types (default: every one "
                                                   "of transformers' image-text-to-text mapping)")

    d = sub.add_parser("data", help="data utilities")
    dsub = d.add_subparsers(dest="data_command", required=True)
    mk = dsub.add_parser("make-demo", help="write the embedded demo dataset and tokenizer")
    mk.add_argument("--out", required=True)
    ev = dsub.add_parser("eval-demo", help="caption held-out demo images with an exported model")
    ev.add_argument("--model", required=True, help="exported HF directory")
    ev.add_argument("--report", help="report.json to add the scores to")
    ev.add_argument("--n", type=int, default=64)
    ck = dsub.add_parser("check", help="scan every source with the model's tokenizer and "
                                       "processors and report its problems (exit 1 on errors)")
    ck.add_argument("--config", required=True, help="ds_omni JSON config")
    ck.add_argument("--sample", type=int, metavar="N", help="check N rows per source, spread over "
                                                            "it (default: every row)")
    ck.add_argument("--json", action="store_true", help="print the report as JSON")
    ck.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                    help="threads decoding images")
    ck.add_argument("--no-progress", action="store_true", help="no progress bar")
    ck.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    return p


def _deepspeed_config_path(arg: str | None) -> str:
    path = arg or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not path:
        raise DsOmniError("no DeepSpeed config: pass --deepspeed ds_configs/zero2.json (or launch "
                          "with an accelerate config that names deepspeed_config_file)")
    return path


def cmd_train(args) -> None:
    from ds_omni.config import load_config
    from ds_omni.train.engine import run
    cfg = load_config(args.config, args.set)
    report = run(cfg, _deepspeed_config_path(args.deepspeed), resume=args.resume,
                 stop_after=args.stop_after)
    if report:
        print(json.dumps({k: v for k, v in report.items()}, indent=1))


def cmd_supervise(args) -> int:
    from ds_omni.errors import ConfigError
    from ds_omni.train.supervise import output_dir_of, supervise
    command = args.run_command[1:] if args.run_command[:1] == ["--"] else args.run_command
    if not command:
        raise ConfigError("ds-omni supervise: no command; pass it after --, e.g. ds-omni "
                          "supervise -- deepspeed --num_gpus 2 --module ds_omni train --config ...")
    if args.max_restarts < 0 or args.backoff < 0:
        raise ConfigError("--max-restarts and --backoff must be >= 0")
    import signal

    def stop(signum, frame):  # a SIGTERM ends the run it supervises too (see run_attempt)
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, stop)
    return supervise(command, args.output_dir or output_dir_of(command), args.max_restarts,
                     args.backoff)


def cmd_convert(args) -> None:
    from ds_omni.data.templates import carry_template, training_template
    from ds_omni.model import convert
    if args.checkpoint:
        out = convert.export_checkpoint(args.checkpoint, args.out, args.tag)
        print(f"wrote HuggingFace model to {out}")
        return
    built = convert.load(args.hf or args.omni)
    # a tokenizer without a template trains on "plain" (data.template "auto"): say so in the export
    carry_template(built.tokenizer, training_template("auto", built))
    if args.hf:
        out = convert.save_omni(built.model, args.out, built.tokenizer, built.model_dir)
        print(f"wrote OmniModel ({built.family.name}: encoders {list(built.model.encoders)}, "
              f"{len(built.model.backbone.layers)} LLM layers) to {out}")
    else:
        out = convert.export_hf(built.model, args.out, built.tokenizer, model_dir=built.model_dir)
        print(f"wrote HuggingFace model ({built.family.name}) to {out}")


def cmd_plan(args) -> None:
    """Print the plan, its rank layout and the derived DeepSpeed config; check what can be checked
    without launching (the world size, the SP degree against the LLM's heads, the reorder group)."""
    from ds_omni.config import load_config
    from ds_omni.data.loader import reorder_group_size
    from ds_omni.ds_config import derive_ds_config, load_ds_json
    from ds_omni.model.build import check_sequence_parallel
    from ds_omni.parallel.plan import ParallelPlan
    cfg = load_config(args.config, args.set)
    plan = ParallelPlan.from_config(cfg.parallel, args.world_size)
    if plan.sp_enabled:
        check_sequence_parallel(cfg.model, plan.sp)
    ds_config = derive_ds_config(cfg, load_ds_json(args.deepspeed), plan)
    out = {"plan": {"world_size": plan.world_size, "dp": plan.dp, "sp": plan.sp, "pp": plan.pp},
           "layout": plan.layout(reorder_group_size(cfg.data, plan.dp)), "deepspeed": ds_config}
    if plan.pp_enabled:
        out["pipeline"] = _pipeline_stages(cfg, plan, ds_config)
    print(_leaf_lines(out))


def _pipeline_stages(cfg, plan, ds_config: dict) -> dict:
    """Stage boundaries and each stage's predicted time, from the cost model of the model built
    on the meta device (its sizes only: no weights are made or read)."""
    import torch
    from ds_omni.model.build import build_model, llm_text_config
    from ds_omni.parallelize.pipeline import check_pipeline
    from ds_omni.parallel.stages import SPLITS, describe
    from ds_omni.train.engine import stage_plan, stage_tokens
    check_pipeline(cfg, ds_config, llm_text_config(cfg.model)[1])
    with torch.device("meta"):
        built = build_model(cfg.model)
    slowest = {split: max(stage_plan(cfg, built, plan, split).stage_time) for split in SPLITS}
    return {"encoder_placement": cfg.parallel.encoder_placement,
            "stage_split": cfg.parallel.stage_split,
            "workload": f"micro-batches of {cfg.train.micro_batch_size} samples x "
                        f"{stage_tokens(cfg)} tokens, one item per encoder each",
            "stages": describe(stage_plan(cfg, built, plan)),
            "slowest_stage_by_split": {split: round(t / slowest[cfg.parallel.stage_split], 4)
                                       for split, t in slowest.items()}}


def _leaf_lines(obj, level: int = 0) -> str:
    """Indented JSON with each leaf list or object (no container inside) on one line, so a layout
    of 64 ranks prints a line per rank and per group rather than a line per number."""
    children = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ()
    if not any(isinstance(c, (dict, list)) for c in children):
        return json.dumps(obj)
    inner = " " * (level + 1)
    if isinstance(obj, dict):
        body = [f"{inner}{json.dumps(k)}: {_leaf_lines(v, level + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(body) + "\n" + " " * level + "}"
    body = [inner + _leaf_lines(v, level + 1) for v in obj]
    return "[\n" + ",\n".join(body) + "\n" + " " * level + "]"


def cmd_calibrate_cost(args) -> None:
    from ds_omni.config import load_config
    from ds_omni.data.calibrate import profile, write
    result = profile(load_config(args.config, args.set), args.batches)
    print(json.dumps(result, indent=1))
    print(f"wrote {write(result, args.out)}; put its cost_scales in data.reorder.cost_scales")


def cmd_families(args) -> None:
    import contextlib
    import json
    import logging
    from ds_omni.model import coverage
    logging.getLogger("transformers").setLevel(logging.ERROR)  # the tiny configs' warnings
    with contextlib.redirect_stdout(sys.stderr):  # libraries' log lines would corrupt --json
        results = coverage.sweep(args.model_types or None)
    if args.json:
        print(json.dumps({t: r.as_dict() for t, r in results.items()}, indent=1))
    else:
        print(coverage.table(results))


def cmd_data(args) -> int:
    from pathlib import Path
    from ds_omni.data import demo
    if args.data_command == "check":
        return _data_check(args)
    if args.data_command == "make-demo":
        out = Path(args.out)
        demo.make_shapes_dataset(out / "dataset")
        demo.make_shapes_tokenizer(out / "tokenizer")
        print(f"wrote {out / 'dataset'} and {out / 'tokenizer'}")
        return
    scores = demo.evaluate_captions(args.model, n=args.n)
    print(json.dumps(scores, indent=1))
    if args.report:
        report = Path(args.report)
        data = json.loads(report.read_text()) if report.exists() else {}
        report.write_text(json.dumps({**data, "caption_eval": scores}, indent=1))
    return 0


def _data_check(args) -> int:
    """Start-up checks first (they explain a wrong schema better than a scan would), then a
    scan of every source; exit status 1 when the data has errors."""
    from ds_omni.config import load_config
    from ds_omni.data.check import check_data, format_report, startup_check
    from ds_omni.model.build import build_model
    from ds_omni.errors import ConfigError
    if args.sample is not None and args.sample < 1:
        raise ConfigError(f"--sample must be >= 1, got {args.sample}")
    cfg = load_config(args.config, args.set)
    startup_check(cfg, media=False)  # the scan lists every missing file
    report = check_data(cfg, build_model(cfg.model), sample=args.sample, workers=args.workers,
                        progress=not args.no_progress)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 1 if report["errors"] else 0


def _drop_local_rank(argv: list[str]) -> list[str]:
    """The deepspeed launcher passes --local_rank=N (before the subcommand); LOCAL_RANK says the same."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a.startswith(("--local_rank=", "--local-rank=")):
            continue
        elif a in ("--local_rank", "--local-rank"):
            skip = True
        else:
            out.append(a)
    return out


def _quiet_libraries() -> None:
    """ds-omni draws its own progress bar; the libraries' per-file bars would bury it."""
    import datasets
    import transformers
    datasets.disable_progress_bars()
    datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0  # else every streaming run ends with 5 s
    transformers.utils.logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(_drop_local_rank(sys.argv[1:] if argv is None else argv))
    _quiet_libraries()
    handler = {"train": cmd_train, "supervise": cmd_supervise, "convert": cmd_convert,
               "plan": cmd_plan, "data": cmd_data, "families": cmd_families,
               "calibrate-cost": cmd_calibrate_cost}
    try:
        return handler[args.command](args) or 0
    except DsOmniError as e:
        print(f"ds-omni: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

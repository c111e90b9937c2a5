"""`ds-omni` command line: parse, build a config, call one function.

Each sub-command has a one-line description and an example in its `--help` (`_command`); the
top-level help shows a first hour's commands (`EXAMPLES`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from ds_omni.errors import ConfigError, DsOmniError, LaunchError

DESCRIPTION = "Train multimodal LLMs (vision/audio encoders + an HF LLM) on DeepSpeed, and plan, " \
    "convert and check a run."
EXAMPLES = """examples:
  ds-omni data make-demo --out data/shapes
  ds-omni plan    --config examples/tiny_llava.json --deepspeed ds_configs/zero2.json --world-size 8
  ds-omni train   --config examples/tiny_llava.json --deepspeed ds_configs/zero2.json [--resume]
  ds-omni convert --checkpoint outputs/run/checkpoints --out outputs/run/hf
  ds-omni data check --config my.json [--sample 1000] [--json]
  ds-omni supervise --max-restarts 3 -- deepspeed --num_gpus 2 --module ds_omni train ...

Launch `train` with any launcher: `deepspeed --num_gpus 2 --module ds_omni train ...`,
`torchrun --nproc_per_node 2 -m ds_omni train ...`, `accelerate launch -m ds_omni train ...`, or
plain `ds-omni train ...` for one process. `ds-omni COMMAND --help` shows each command's options;
docs/config.md lists every config field."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-omni", description=DESCRIPTION, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="command")
    for add in (_train_args, _supervise_args, _convert_args, _plan_args, _calibrate_args,
                _families_args, _data_args):
        add(sub)
    return p


def _command(sub, name: str, what: str, *examples: str) -> argparse.ArgumentParser:
    """A sub-command whose help says what it does in one line (`what`, also its line in the
    parent's list) and shows how it is called (`examples`, under "example:")."""
    epilog = ("example:" if len(examples) == 1 else "examples:") + \
        "".join(f"\n  {e}" for e in examples)
    return sub.add_parser(name, help=what, description=what, epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def _set_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set train.steps=10 (a JSON value; "
                             "repeatable; docs/config.md lists the fields)")


def _train_args(sub) -> None:
    t = _command(sub, "train", "Train a model from a ds_omni config and a DeepSpeed config.",
                 "ds-omni train --config examples/tiny_llava.json "
                 "--deepspeed ds_configs/zero2.json",
                 "deepspeed --num_gpus 2 --module ds_omni train --config examples/tiny_llava.json "
                 "--deepspeed ds_configs/zero2.json")
    t.add_argument("--config", required=True, help="ds_omni JSON config")
    t.add_argument("--deepspeed", help="DeepSpeed JSON config (default: the one accelerate passes)")
    t.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    t.add_argument("--stop-after", type=int, help="stop (with a checkpoint) after N steps of this run")
    _set_arg(t)


def _supervise_args(sub) -> None:
    sv = _command(sub, "supervise", "Run a training command; after a failure, restart it from its "
                                    "newest complete checkpoint.",
                  "ds-omni supervise --max-restarts 3 --backoff 10 -- deepspeed --num_gpus 2 "
                  "--module ds_omni train --config my.json --deepspeed ds_configs/zero2.json")
    sv.add_argument("--max-restarts", type=int, default=3, help="restarts before giving up")
    sv.add_argument("--backoff", type=float, default=10.0,
                    help="seconds before the first restart, doubling for each next one")
    sv.add_argument("--output-dir", help="the run's train.output_dir (default: read from the "
                                         "command's --config and --set)")
    sv.add_argument("run_command", nargs=argparse.REMAINDER, metavar="command",
                    help="-- then the training command, e.g. -- deepspeed --num_gpus 8 --module "
                         "ds_omni train --config my.json --deepspeed ds_configs/zero2.json")


def _convert_args(sub) -> None:
    c = _command(sub, "convert", "Convert between HF directories, OmniModel directories and "
                                 "training checkpoints.",
                 "ds-omni convert --checkpoint outputs/run/checkpoints --out outputs/run/hf")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint",
                     help="<output_dir>/checkpoints of a run (any ZeRO stage, pp, tp, ep) -> HF")
    src.add_argument("--hf", help="an HF MLLM directory -> an OmniModel directory")
    src.add_argument("--omni", help="an OmniModel directory -> an HF directory")
    c.add_argument("--tag", help="checkpoint tag (default: latest)")
    c.add_argument("--out", required=True, help="output directory")


def _plan_args(sub) -> None:
    pl = _command(sub, "plan", "Print the parallel plan, its rank layout and the derived DeepSpeed "
                               "config, without launching.",
                  "ds-omni plan --config examples/tiny_llava.json --deepspeed "
                  "ds_configs/zero2.json --world-size 8", "ds-omni plan --composition")
    pl.add_argument("--config", help="ds_omni JSON config (required but for --composition)")
    pl.add_argument("--deepspeed", help="DeepSpeed JSON config (required but for --composition)")
    pl.add_argument("--composition", action="store_true",
                    help="print which parallel features compose, and why a pair is refused "
                         "(docs/composition.md)")
    pl.add_argument("--world-size", type=int, help="ranks the run would have (--simulate: --gpus)")
    pl.add_argument("--gpus-per-node", type=int, default=None,
                    help="ranks per node: also print which groups cross nodes (--simulate: "
                         "GPUs per node, default 8)")
    pl.add_argument("--simulate", action="store_true",
                    help="simulate one step of the plan and five baselines (docs/simulator.md)")
    pl.add_argument("--search", action="store_true",
                    help="search the plan space on the cluster: the best plans, their predicted "
                         "step time, MFU and memory, the baselines, why others were dropped")
    pl.add_argument("--top", type=int, default=5, help="--search: plans to print")
    pl.add_argument("--budget", type=float, default=None,
                    help="--search: stop after this many seconds of CPU time (then the best "
                         "found so far)")
    pl.add_argument("--gpus", type=int, help="--simulate / --search: GPUs of the cluster")
    pl.add_argument("--gpu", default="h100", help="--simulate / --search: h100, h200, a100, cpu "
                                                  "or a cluster file of `ds-omni calibrate-comm`")
    pl.add_argument("--workload", help="--simulate: a `ds-omni data check --json` report or "
                                       "WorkloadSpec fields (JSON); default: a mixed workload")
    pl.add_argument("--seed", type=int, default=0, help="--simulate: seed of the drawn samples")
    pl.add_argument("--json", action="store_true", help="--simulate: print JSON")
    _set_arg(pl)


def _calibrate_args(sub) -> None:
    cc = _command(sub, "calibrate-cost", "Time micro-batches on this machine and fit the cost "
                                         "model's scales (data.reorder.cost_scales).",
                  "ds-omni calibrate-cost --config examples/tiny_llava.json --out cost_scales.json")
    cc.add_argument("--config", required=True, help="ds_omni JSON config")
    cc.add_argument("--batches", type=int, default=30, help="micro-batches to time (a size)")
    cc.add_argument("--sizes", type=int, nargs="+", help="samples a micro-batch, several (e.g. "
                    "1 2 4 8): also fits the simulator's FLOP/s and per-micro-batch seconds")
    cc.add_argument("--out", required=True, help="JSON file for the fitted scales")
    _set_arg(cc)
    cm = _command(sub, "calibrate-comm", "Time collectives over gloo on this machine and fit the "
                                         "simulator's link (alpha-beta) into a cluster file.",
                  "ds-omni calibrate-comm --ranks 2 4 --out cpu_cluster.json && ds-omni plan "
                  "--config C.json --deepspeed D.json --simulate --gpus 4 --gpu cpu_cluster.json")
    cm.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="process counts to time")
    cm.add_argument("--repeats", type=int, default=9, help="timings of each size (median kept)")
    cm.add_argument("--out", required=True, help="JSON cluster file (`--gpu FILE` loads it)")


def _families_args(sub) -> None:
    fm = _command(sub, "families", "Say which transformers vision-language model types ds_omni "
                                   "trains exactly (a tiny model of each, checked against HF).",
                  "ds-omni families llava qwen2_vl")
    fm.add_argument("--json", action="store_true",
                    help='print {model_type: {"supported": bool, "reason": str}}')
    fm.add_argument("model_types", nargs="*", help="only these model types (default: every one "
                                                   "of transformers' image-text-to-text mapping)")


def _data_args(sub) -> None:
    d = _command(sub, "data", "Data utilities: write the demo data, check a config's sources, "
                              "score a demo model.",
                 "ds-omni data check --config examples/tiny_llava.json --sample 1000")
    dsub = d.add_subparsers(dest="data_command", required=True, metavar="data_command")
    mk = _command(dsub, "make-demo", "Write the embedded demo dataset and tokenizer to a folder.",
                  "ds-omni data make-demo --out data/shapes")
    mk.add_argument("--out", required=True, help="folder for dataset/ and tokenizer/")
    ev = _command(dsub, "eval-demo", "Caption held-out demo images with an exported model and "
                                     "score the captions.",
                  "ds-omni data eval-demo --model outputs/run/hf --report outputs/run/report.json")
    ev.add_argument("--model", required=True, help="exported HF directory")
    ev.add_argument("--report", help="report.json to add the scores to")
    ev.add_argument("--n", type=int, default=64, help="held-out images to caption")
    _data_check_args(dsub)


def _data_check_args(dsub) -> None:
    ck = _command(dsub, "check", "Scan every source with the model's tokenizer and processors and "
                                 "report its problems (exit 1 on errors).",
                  "ds-omni data check --config examples/tiny_llava.json --sample 1000")
    ck.add_argument("--config", required=True, help="ds_omni JSON config")
    ck.add_argument("--sample", type=int, metavar="N", help="check N rows per source, spread over "
                                                            "it (default: every row)")
    ck.add_argument("--json", action="store_true", help="print the report as JSON")
    ck.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                    help="threads decoding images")
    ck.add_argument("--no-progress", action="store_true", help="no progress bar")
    _set_arg(ck)


def _deepspeed_config_path(arg: str | None) -> str:
    path = arg or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not path:
        raise DsOmniError("no DeepSpeed config: pass --deepspeed ds_configs/zero2.json (or launch "
                          "with an accelerate config that names deepspeed_config_file)")
    return path


def cmd_train(args) -> None:
    from ds_omni.config import load_config
    from ds_omni.train.loop import run
    cfg = load_config(args.config, args.set)
    report = run(cfg, _deepspeed_config_path(args.deepspeed), resume=args.resume,
                 stop_after=args.stop_after)
    if report:
        print(json.dumps({k: v for k, v in report.items()}, indent=1))


def cmd_supervise(args) -> int:
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
    from ds_omni.model.build import load
    if args.checkpoint:
        out = convert.export_checkpoint(args.checkpoint, args.out, args.tag)
        print(f"wrote HuggingFace model to {out}")
        return
    built = load(args.hf or args.omni)
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
    """Print the plan, its rank layout and the derived DeepSpeed config (and the pipeline's
    stages), as the training's own set-up builds them (`ds_omni.train.setup.plan_run`): what can
    be checked without launching is checked (the world size, the SP degree against the LLM's
    heads, the reorder group). --simulate / --search: the simulator's report instead;
    --composition: the table of what composes (no config)."""
    if args.composition:
        from ds_omni.config.composition_doc import markdown
        print(markdown(), end="")
        return
    missing = [f"--{name}" for name in ("config", "deepspeed") if getattr(args, name) is None]
    if missing:
        raise ConfigError(f"ds-omni plan needs {' and '.join(missing)} (or --composition alone)")
    if not (args.simulate or args.search):
        from ds_omni.config import load_config
        from ds_omni.train.ds_config import load_ds_json
        from ds_omni.train.setup import describe_plan, plan_run
        if args.world_size is None:
            raise LaunchError("ds-omni plan needs --world-size N (or --simulate / --search --gpus N)")
        cfg = load_config(args.config, args.set)
        plan, ds_config = plan_run(cfg, load_ds_json(args.deepspeed), args.world_size)
        print(_leaf_lines(describe_plan(cfg, plan, ds_config, args.gpus_per_node)))
        return
    if args.gpus is None:
        raise LaunchError("ds-omni plan --simulate / --search needs --gpus N (the cluster's GPUs)")
    if not args.json:
        print(_simulated(args))
        return
    # stdout holds the JSON alone: DeepSpeed's logger (its accelerator line, AutoTP's warnings)
    # writes to the stdout its handler saw when deepspeed was imported
    with contextlib.redirect_stdout(sys.stderr):
        _logs_to_stderr()
        out = _simulated(args)
    print(json.dumps(out, indent=1))


def _simulated(args) -> "dict | str":
    """The simulator's report of the config's plan (--simulate) or the plan search (--search):
    a dict under --json, else the text for people."""
    from ds_omni.config import load_config
    from ds_omni.sim.from_config import format_simulation, search_config, simulate_config
    from ds_omni.sim.search import format_search
    from ds_omni.train.ds_config import load_ds_json
    cfg, ds_json = load_config(args.config, args.set), load_ds_json(args.deepspeed)
    where = dict(gpus=args.gpus, gpus_per_node=args.gpus_per_node or 8, gpu=args.gpu,
                 workload=args.workload, seed=args.seed)
    if args.search:
        out = search_config(cfg, ds_json, top=args.top, budget_s=args.budget, **where)
        return out if args.json else format_search(out)
    out = simulate_config(cfg, ds_json, **where)
    return out if args.json else format_simulation(out)


def _logs_to_stderr() -> None:
    """Under --json stdout holds the JSON alone: DeepSpeed's logger (its accelerator line, AutoTP's
    warnings) writes to stdout through a handler made at its import, so point it at stderr."""
    from deepspeed.utils import logger
    for handler in logger.handlers:
        if getattr(handler, "stream", None) in (sys.__stdout__, sys.stdout):
            handler.setStream(sys.stderr)


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
    from ds_omni.train.calibrate import profile, write
    result = profile(load_config(args.config, args.set), args.batches,
                     sizes=tuple(args.sizes) if args.sizes else None)
    print(json.dumps(result, indent=1))
    print(f"wrote {write(result, args.out)}; put its cost_scales in data.reorder.cost_scales")


def cmd_calibrate_comm(args) -> None:
    from ds_omni.sim.calibrate_comm import calibrate, write
    result = calibrate(tuple(args.ranks), repeats=args.repeats)
    print(json.dumps({k: result[k] for k in ("cluster", "median_rel_error", "max_rel_error")},
                     indent=1))
    print(f"wrote {write(result, args.out)}; simulate with --gpu {args.out}")


def cmd_families(args) -> None:
    import contextlib
    import json
    import logging
    from ds_omni.coverage import sweep
    logging.getLogger("transformers").setLevel(logging.ERROR)  # the tiny configs' warnings
    with contextlib.redirect_stdout(sys.stderr):  # libraries' log lines would corrupt --json
        results = sweep.sweep(args.model_types or None)
    if args.json:
        print(json.dumps({t: r.as_dict() for t, r in results.items()}, indent=1))
    else:
        print(sweep.table(results))


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
               "calibrate-cost": cmd_calibrate_cost, "calibrate-comm": cmd_calibrate_comm}
    try:
        return handler[args.command](args) or 0
    except DsOmniError as e:
        print(f"ds-omni: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

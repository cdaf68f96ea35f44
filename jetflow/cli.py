"""`jetflow` command line: train | ablate | bench | convert | export | generate.

Commands that take a config accept `--config FILE` and any number of `key=value` overrides.
"""

from __future__ import annotations

import argparse
import sys


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "gemm":
        from jetflow.bench import gemm
        gemm.run(shapes=args.shapes, device=args.device, iters=args.iters, out_dir=args.out_dir,
                 backend=args.backend)
        return 0
    if args.what == "linear":
        from jetflow.bench import linear
        linear.run(device=args.device, iters=args.iters, out_dir=args.out_dir)
        return 0
    raise SystemExit(f"unknown benchmark {args.what!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetflow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks (results/bench/)")
    bench.add_argument("what", choices=["gemm", "linear"], help="which benchmark")
    bench.add_argument("--shapes", default=None, help="comma-separated MxNxK (default: a device-specific list)")
    bench.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    bench.add_argument("--iters", type=int, default=5)
    bench.add_argument("--backend", default="auto", help="FP8 GEMM backend: auto | scaled_mm | emulate")
    bench.add_argument("--out-dir", default="results/bench")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The `workbench` command.

Each sub-command lives in its own module, imported only when used so that
`workbench asm ls` stays fast (no torch import). A module provides
`configure(parser)` to add its arguments and `run(args) -> int`. Where a command's
work may run elsewhere (sweep, report, tune), its command line chooses the executor
(`--executor local|slurm`, ``workbench.executors``) and the command hands its work to it.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS = {
    "asm": ("workbench.asm.cli", "inspect, compile and diff kernels in the Triton cache"),
    "profile": ("workbench.profile.cli", "hardware counters per source line: run ncu (GPU), show a report (CPU)"),
    "report": ("workbench.report_command", "re-run notebooks headless into self-contained HTML"),
    "sweep": ("workbench.sweep_command", "run a declared parameter sweep into results/"),
    "tune": ("workbench.tune_command", "build a kernel family's tuning table for this GPU (or --show one)"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        # Only the chosen sub-command's module is imported.
        if name == wanted:
            mod = importlib.import_module(module)
            mod.configure(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

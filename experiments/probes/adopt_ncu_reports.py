"""Bring reports of the first ncu probe into the layout `workbench profile run` writes (CPU, no ncu).

    python experiments/probes/adopt_ncu_reports.py PROBE_DIR OUT CASE ... [--no-cache] [--csv]

The probe (``git show 72a8714:experiments/probes/ncu_cases.sh``, run on one H200 on 2026-11-28 with
ncu 2025.3.1) wrote PROBE_DIR/CASE.ncu-rep and the run's Triton cache as PROBE_DIR/cache_CASE/;
its ncu command was the one `workbench profile run` runs now (the same sections, source imported,
``--clock-control none``, the first matching launch). For each CASE this writes OUT/NAME.ncu-rep,
OUT/NAME.triton-cache/HASH/ (the profiled kernel's entry only; left out with --no-cache, the hash
still recorded), OUT/NAME.sass.csv (with --csv: ncu's own CSV, PROBE_DIR/CASE.sass.csv) and
OUT/NAME.json (the summary, saying how the report was made). NAME is the case's name in
`experiments/profile_cases.py` (the probe's ``torch`` is ``torch_mm`` there).
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from workbench.profile.lines import find_entry  # noqa: E402
from workbench.profile.report import load  # noqa: E402
from workbench.profile.run import DEFAULT_SECTIONS, write_summary  # noqa: E402

PROBE_COMMIT = "72a8714e489d6da968ef3ecf27d465a5019654f4"
KERNEL = {"gemm": "_gemm_tma", "gluon": "_gemm_ws", "put": "put_kernel", "put_noline": "put_kernel",
          "hint0": "remote_store_kernel", "hint1": "remote_store_kernel", "mxfp4": "_moe_mxfp4_down_kernel",
          "torch": "nvjet|gemm|cutlass|sm90"}
NAME = {"torch": "torch_mm"}


def probe_command(case: str) -> str:
    env = "TRITON_DISABLE_LINE_INFO=1 " if case == "put_noline" else ""
    sections = " ".join(f"--section {s}" for s in DEFAULT_SECTIONS)
    return (f"{env}TRITON_CACHE_DIR=OUT/cache_{case} ncu --clock-control none {sections} --import-source yes "
            f"-k regex:{KERNEL[case]} --launch-count 1 -f -o OUT/{case} python3 experiments/probes/ncu_cases.py "
            f"{'put' if case == 'put_noline' else case}")


def adopt(probe: Path, out: Path, case: str, keep_cache: bool, csv: bool) -> dict:
    name = NAME.get(case, case)
    report = out / f"{name}.ncu-rep"
    shutil.copyfile(probe / f"{case}.ncu-rep", report)
    if csv:
        shutil.copyfile(probe / f"{case}.sass.csv", out / f"{name}.sass.csv")
    cache = out / f"{name}.triton-cache"
    shutil.rmtree(cache, ignore_errors=True)
    entry = None
    if (probe / f"cache_{case}").is_dir():
        try:
            entry = find_entry(load(report), probe / f"cache_{case}")[0]
        except Exception as exc:  # a library kernel: no entry
            print(f"{case}: {exc}")
    if entry is not None:
        shutil.copytree(entry.path, cache / entry.hash)
    facts = {
        "made_by": f"experiments/probes/ncu_cases.sh (git show {PROBE_COMMIT[:7]}:experiments/probes/ncu_cases.sh), "
                   "brought into this layout by experiments/probes/adopt_ncu_reports.py",
        "target": f"experiments/probes/ncu_cases.py {'put' if case == 'put_noline' else case}",
        "kernel_regex": KERNEL[case], "launch": 1, "sections": list(DEFAULT_SECTIONS), "clock_control": "none",
        "command": probe_command(case), "ncu": "ncu", "ncu_version": "2025.3.1", "created": "2026-11-28",
        "git_sha": PROBE_COMMIT, "git_dirty": None, "git_source": "the probe's commit",
        "python_version": "3.12", "torch_version": None, "cuda_version": None,
        "triton_version": entry.triton_version if entry is not None else None,
    }
    summary = write_summary(report, cache if entry is not None else None, facts)
    if entry is not None and not keep_cache:
        shutil.rmtree(cache)
        summary.update(cache=None, entry_note=f"the entry ({entry.hash}, {_size(entry.path)}) is not kept here: "
                                              "re-make the report to have it beside")
        (out / f"{name}.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return summary


def _size(path: Path) -> str:
    return f"{sum(p.stat().st_size for p in path.rglob('*') if p.is_file()) / 2**20:.1f} MB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("probe", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("cases", nargs="+", choices=sorted(KERNEL))
    p.add_argument("--no-cache", action="store_true", help="record the entry's hash but do not copy the entry")
    p.add_argument("--csv", action="store_true", help="copy ncu's CSV of each report too")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for case in args.cases:
        s = adopt(args.probe, args.out, case, not args.no_cache, args.csv)
        print(f"{case}: {args.out / s['report']} ({s['report_bytes'] / 1024:,.0f} kB), kernel {s['kernel']}, "
              f"entry {s['hash'] or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

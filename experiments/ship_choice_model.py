"""Ship the choice models of finished overlap runs: merge each family's model of every run folder
given (``<run>/ag_gemm/tables/<GPU>/ag_gemm.model.json``, the same for ``gemm_scatter``; written by
``run_ag_gemm.py`` / ``run_gemm_scatter.py --shape-set ...`` or ``run_overlap.py --refit``) into
``kernels/common/tables/<GPU>/<family>.model.json``, which ``auto_config`` reads for shapes no
table entry has. Runs of different world sizes add up; a later run replaces an earlier one's
group of the same world size (and gather dim).

    python3 experiments/ship_choice_model.py results/overlap/h200_w2 results/overlap/h200_w4
"""
import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kernels.comm import choice_model  # noqa: E402
from kernels.common.tables import SHIPPED_ROOT  # noqa: E402

FAMILIES = ("ag_gemm", "gemm_scatter")


def ship(runs: list[Path], root: Path = SHIPPED_ROOT) -> list[Path]:
    """The merged models written under ``root`` (one per GPU and family found)."""
    found: dict = {}
    for run in runs:
        for family in FAMILIES:
            for path in sorted((run / family / "tables").glob(f"*/{family}{choice_model.SUFFIX}")):
                model = choice_model.load(path, family)
                found.setdefault((path.parent.name, family), []).append((path, model))
    written = []
    for (gpu, family), items in sorted(found.items()):
        merged = choice_model.merge([m for _, m in items],
                                    source="; ".join(str(p.relative_to(REPO) if p.is_relative_to(REPO) else p)
                                                     for p, _ in items))
        written.append(choice_model.save(root / gpu / f"{family}{choice_model.SUFFIX}", merged))
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run folders (each with ag_gemm/ and gemm_scatter/)")
    ap.add_argument("--root", default=str(SHIPPED_ROOT), help="tables root to write (default: the shipped one)")
    args = ap.parse_args(argv)
    written = ship([Path(r).resolve() for r in args.runs], Path(args.root))
    if not written:
        print("ship_choice_model: no choice model found under the runs given", file=sys.stderr)
        return 1
    print("wrote", ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())

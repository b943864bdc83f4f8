"""Score a fitted choice model on another run's measurements (no GPU).

A run of the overlap study times every candidate on its held-out half and on shapes drawn at
run time; a model fitted on an earlier run (``run_overlap.py --refit [--fit-random]``) has seen
none of them. This replays the model's pick on every such shape of ``RUN`` and scores it against
the best candidate within the tolerance there (``overlap.score_held_out``), beside the
launcher's own pick as that run measured it (``auto``, the model shipped then):

    python3 experiments/score_choice_model.py results/overlap/h200_w2_fresh --model results/overlap/h200_w2

writes ``RUN/<family>/choice_scores_model.csv`` and prints the summary lines.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import overlap  # noqa: E402
import run_ag_gemm  # noqa: E402
import run_gemm_scatter  # noqa: E402
from run_overlap import run_rows  # noqa: E402

from kernels.comm import choice_model  # noqa: E402


def score(run: Path, model_run: Path, world_size: int) -> list[str]:
    import pandas as pd

    lines = []
    bench, times = run_rows(run, world_size)
    for study, sub, rows in ((run_ag_gemm.AG_GEMM, "ag_gemm", bench),
                             (run_gemm_scatter.GEMM_SCATTER, "gemm_scatter", run_gemm_scatter.overlap_rows(times))):
        model = choice_model.load(model_run / sub / "choice_model.json", study.family)
        if model is None:
            raise SystemExit(f"score_choice_model: no {sub}/choice_model.json in {model_run}")
        frames = []
        for split in ("held_out", "random"):
            for rule, pick, failed in (("model", overlap.model_pick(study, model), False),
                                       ("measured", lambda case, timing: overlap.AUTO, True)):
                s = overlap.score_held_out(rows, [], list(study.keys), list(study.match_keys), study.choices,
                                           study.libraries, study.gemm, study.comm, fused=study.fused, pick=pick,
                                           split=split, keep_failed=failed)
                if len(s):
                    frames.append(s.assign(split=split, rule=rule))
                    label = "the model of " + str(model_run) if rule == "model" else overlap.RULES[rule]
                    lines += overlap.summary_lines(s, f"{study.name} [{split}, {label}]", list(study.match_keys))
        pd.concat(frames, ignore_index=True).to_csv(run / sub / "choice_scores_model.csv", index=False)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="the run whose measurements score the model (its ag_gemm/ and gemm_scatter/)")
    ap.add_argument("--model", required=True, help="the run folder whose choice_model.json files are scored")
    ap.add_argument("--world-size", type=int, default=2)
    args = ap.parse_args(argv)
    print("\n".join(score(Path(args.run), Path(args.model), args.world_size)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

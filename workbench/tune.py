"""``workbench tune``: build a family's tuning table for this GPU from a list of shapes.

    workbench tune gemm --shapes experiments/gemm_shapes.yaml               # into your tables
    workbench tune gemm --shapes "M=4096,N=4096,K=4096;M=16,N=8192,K=8192"  # shapes inline
    workbench tune grouped --shapes experiments/grouped_gemm_layers.yaml --budget-s 4
    workbench tune gemm --shapes SPEC --out kernels/common/tables            # the tables the package ships
    workbench tune --show [FAMILY] [--device "NVIDIA H100 80GB HBM3"]        # what a device's tables hold
    workbench tune gemm --shapes SPEC --executor slurm --partition h100,h200 --out DIR   # a job per partition
    workbench tune --collect --out DIR                                       # after --detach: how the jobs ended

(the command: ``workbench.tune_command``, which hands the tuning to an executor; this module tunes).

Each shape is timed on this process's GPU (every candidate of the family, the cold rule's
first; ``kernels.common.tune``) and its winner written to the table as soon as it is known,
so an interrupted run keeps what it measured and a second run of the same command resumes
with the shapes not yet in the table (``--redo`` tunes them again). ``--times CSV`` also
appends every candidate's time per shape (what ``experiments/fit_gemm_cold_rule.py`` fits the
cold rule on). Without a GPU the shapes run in Triton's interpreter (small shapes only: the
table is then the interpreter's, for trying the command).

On a cluster (``--executor slurm``, ``workbench.executors``): one job per partition (and
family), each on one GPU of its partition, tunes the spec into the tables under ``--out`` (a
shared filesystem: each GPU model has its own file there) and appends to ``--times`` with the
partition in its name; the command follows the jobs and prints how each ended (``--detach``
returns at once; ``--collect`` reports later). One command builds the H100 and H200 tables.

A shape spec is a YAML or JSON file (read bounded: ``workbench.safe_yaml``) holding a list of
shapes, or a mapping with a ``shapes:`` list, each shape a mapping of the family's fields (the
GEMM's: M, N, K, dtype, b); or the same inline: ``name=value`` pairs joined by ``,``, shapes
joined by ``;``. ``--where split=held_out`` keeps the shapes whose field has that value.
"""
from __future__ import annotations

import csv
import importlib
import json
import sys
from pathlib import Path
from typing import Any, Mapping

# family name (its tables' file name, the module's NAME) -> the module that tunes it
FAMILIES = {"gemm": "kernels.gemm.tuning", "grouped": "kernels.moe.select", "moe_mxfp4": "kernels.moe_mxfp4.select"}
MAX_SHAPES = 100_000


class TuneError(ValueError):
    """A spec or argument refused; the message says what to change."""


# The multi-GPU families' variant choices share the tables (``--show`` lists them) but are measured
# by their overlap study on a node of several GPUs, every rank together, not by this command.
MULTI_GPU = {"ag_gemm": "experiments/run_overlap.py", "gemm_scatter": "experiments/run_overlap.py"}


def family_module(name: str):
    if name in MULTI_GPU:
        raise TuneError(f"{name}: its variant choice is measured on a multi-GPU node by {MULTI_GPU[name]} "
                        f"(every rank together), which writes its table under OUT/{name}/tables/; "
                        f"`workbench tune --show {name}` lists the tables")
    if name not in FAMILIES:
        raise TuneError(f"unknown family {name!r}: choose one of {', '.join(FAMILIES)}")
    return importlib.import_module(FAMILIES[name])


# --------------------------------------------------------------------------
# Shape specs
# --------------------------------------------------------------------------
def _scalar(text: str) -> Any:
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        return text


def parse_inline(text: str) -> list[dict]:
    """``M=1,N=2,K=3;M=4,N=5,K=6`` -> [{'M': 1, 'N': 2, 'K': 3}, ...]."""
    shapes = []
    for part in text.split(";"):
        if not part.strip():
            continue
        row = {}
        for kv in part.split(","):
            if "=" not in kv:
                raise TuneError(f"--shapes {text!r}: {kv.strip()!r} is not name=value (shapes are name=value pairs "
                                f"joined by ',', shapes joined by ';'), or give a YAML file")
            k, v = kv.split("=", 1)
            row[k.strip()] = _scalar(v)
        shapes.append(row)
    return shapes


def load_shapes(spec: str, family, where: Mapping[str, str] | None = None) -> list[dict]:
    """The spec's shapes, each checked by the family (``shape_of``), filtered by ``where``."""
    from workbench import safe_yaml

    if Path(spec).is_file() or spec.endswith((".yaml", ".yml", ".json")):
        try:
            doc = safe_yaml.load_file(spec)
        except safe_yaml.YamlError as exc:
            raise TuneError(str(exc)) from None
        rows = doc.get("shapes") if isinstance(doc, dict) else doc
        if not isinstance(rows, list):
            raise TuneError(f"{spec}: expected a list of shapes, or a mapping with a 'shapes' list")
    else:
        rows = parse_inline(spec)
    if len(rows) > MAX_SHAPES:
        raise TuneError(f"{spec}: {len(rows)} shapes, more than {MAX_SHAPES}; split the spec")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TuneError(f"{spec}: shape {i} is {type(row).__name__}, not a mapping of the family's fields")
        if where and any(str(row.get(k)) != v for k, v in where.items()):
            continue
        try:
            out.append(family.shape_of(row))
        except ValueError as exc:
            raise TuneError(f"{spec}: shape {i}: {exc}") from None
    if not out:
        raise TuneError(f"{spec}: no shapes" + (f" with {where}" if where else ""))
    return out


# --------------------------------------------------------------------------
# Tuning
# --------------------------------------------------------------------------
def this_device() -> dict[str, str]:
    import torch

    from kernels.common import interpreter, select

    if interpreter.active() or not torch.cuda.is_available():
        return select.device_of(None)
    return select.device_of(torch.cuda.current_device())


def tune(family_name: str, shapes: list[dict], *, root: Path | None = None, budget: float | None = None,
         redo: bool = False, times_csv: Path | None = None, log=print) -> dict[str, dict]:
    """Tune every shape not yet in the table under ``root`` (default: the user's tables);
    returns {key: entry} of the shapes tuned now."""
    from tqdm import tqdm

    from kernels.common import tables

    family = family_module(family_name)
    device = this_device()
    root = Path(root) if root is not None else tables.user_root()
    path = tables.table_path(root, device, family.NAME)
    head = tables.header(device, family.NAME)
    have = tables.read(path, {k: head[k] for k in ("device", "capability", "triton", "family")})
    todo = [s for s in shapes if redo or family.key_of(s) not in have]
    log(f"tune {family.NAME} on {device['name']} ({device['capability']}): {len(shapes)} shapes, "
        f"{len(shapes) - len(todo)} already in {path}, {len(todo)} to tune")
    done: dict[str, dict] = {}
    bar = tqdm(todo, desc=f"tune {family.NAME}", unit="shape", file=sys.stderr, dynamic_ncols=True)
    for i, shape in enumerate(bar):
        label = ",".join(f"{k}={shape[k]}" for k in shape if k not in ("source", "split"))
        bar.set_postfix_str(label[:60])
        try:
            key, entry, result = family.tune_shape(shape, budget=budget, seed=1000 + i)
        except Exception as exc:   # one shape that cannot run: said, the rest go on
            log(f"  {label}: not tuned ({type(exc).__name__}: {str(exc)[:300]})")
            continue
        tables.write_entry(path, head, key, entry)
        done[key] = entry
        if times_csv is not None:
            _append_times(times_csv, device, family.NAME, key, shape, entry, result)
        gain = entry["cold_us"] / entry["us"] if entry["us"] else float("nan")
        log(f"  {key}: {entry['candidate']} ({entry['variant']}) {entry['us']:.1f} us, cold {entry['cold']} "
            f"{entry['cold_us']:.1f} us (x{gain:.2f}), {entry['timed']}/{entry['of']} timed in "
            f"{entry['elapsed_s']:.1f} s")
    bar.close()
    log(f"wrote {len(done)} entries to {path}")
    return done


def _append_times(path: Path, device, family: str, key: str, shape: Mapping, entry: Mapping, result) -> None:
    """One row per candidate timed: what fits a cold rule."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with open(path, "a", newline="") as fh:
        w = csv.writer(fh)
        if new:
            w.writerow(["device", "family", "key", "shape", "candidate", "us", "rel_spread", "status", "winner",
                        "cold", "how", "date", "git"])
        shape_json = json.dumps({k: v for k, v in shape.items()}, sort_keys=True)
        for name, us in result.times_us.items():
            w.writerow([device["name"], family, key, shape_json, name, f"{us:.3f}",
                        f"{result.spreads.get(name, 0.0):.4f}", "ok", entry["candidate"], entry["cold"],
                        entry["how"], entry["date"], entry["git"]])
        for name, why in result.failed.items():
            w.writerow([device["name"], family, key, shape_json, name, "", "", why[:200], entry["candidate"],
                        entry["cold"], entry["how"], entry["date"], entry["git"]])


# --------------------------------------------------------------------------
# --show
# --------------------------------------------------------------------------
def show(family_name: str | None, device_name: str | None, roots: list[tuple[str, Path]], log=print) -> int:
    """Print every entry of the tables for a device (all devices with tables when no GPU and
    no --device), with how and when each was measured."""
    from kernels.common import tables

    families = [family_name] if family_name else [*FAMILIES, *MULTI_GPU]
    if device_name is None:
        try:
            device_name = this_device()["name"]
        except Exception:   # no torch: every device present
            device_name = None
    shown = 0
    for where, root in roots:
        if not root.is_dir():
            continue
        for dev_dir in sorted(p for p in root.iterdir() if p.is_dir()):
            if device_name and dev_dir.name != tables.device_slug(device_name):
                continue
            for fam in families:
                path = dev_dir / f"{fam}.json"   # a family's table is named for it (its NAME)
                if not path.is_file():
                    continue
                entries = tables.read(path)
                head = _header_of(path)
                log(f"{where} table {path}: {head.get('device')} (capability {head.get('capability')}), Triton "
                    f"{head.get('triton')}, {len(entries)} entries")
                for key in sorted(entries):
                    e = entries[key]
                    gain = e["cold_us"] / e["us"] if e.get("us") and e.get("cold_us") else float("nan")
                    cold = (f"cold {e.get('cold', '?')} {e.get('cold_us', float('nan')):.1f} us (x{gain:.2f}); "
                            f"{e.get('timed', '?')}/{e.get('of', '?')} timed, " if "cold" in e else "")
                    log(f"  {key}: {e['candidate']} ({e['variant']}) {e.get('us', float('nan')):.1f} us; {cold}"
                        f"{e.get('how', '?')}; {e.get('by', '?')} "
                        f"{e.get('date', '?')} git {str(e.get('git', '?'))[:10]} torch {e.get('torch', '?')}")
                shown += 1
    if not shown:
        log(f"no tables for {device_name or 'any device'}" + (f" ({family_name})" if family_name else "") +
            f" under {', '.join(str(r) for _, r in roots)}")
    return 0


def _header_of(path: Path) -> dict:
    from kernels.common import tables

    try:
        with open(path, "rb") as fh:
            doc = json.loads(fh.read(tables.MAX_TABLE_BYTES + 1))
        return {k: doc.get(k) for k in ("device", "capability", "triton", "family")} if isinstance(doc, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}

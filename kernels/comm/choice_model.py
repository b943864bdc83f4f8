"""The multi-GPU families' variant choice off the table: every candidate's time predicted.

A tuning-table entry says which method won on one measured shape. Its winner, taken for the
nearest unseen shape, was 2.2x behind NCCL + cuBLAS at 4 ranks on 256x16384x16384: the winner
changes between measured shapes and beyond them. This model predicts each candidate's time on
the shape asked and the choice takes the fastest, among the candidates that stayed within the
dtype's tolerance on every fitted shape of the group.

Per group (the fields a problem must match: world size, gather dim) and per mode (``eager``
calls, host cost included, or ``graph`` replays: PyTorch's fused op spends 0.3-0.8 ms of host
time per eager call that a graph replay does not), three least-squares fits, in relative error
(each row weighted by 1 / its time, so a 20 us shape counts as much as a 20 ms one):

    T_gemm = a * flop + b * gemm_bytes + c                       the GEMM alone's rows
    T_comm = d * comm_bytes + e                                  the collective alone's rows
    T_x    = al * T_gemm + be * T_comm + ga * max(T_gemm, T_comm) + de      each candidate x

T_x is fitted on the predicted T_gemm and T_comm (not the measured ones), so a fit and a choice
see the same features. Every coefficient is >= 0: a time cannot fall as work grows, and a
negative term fitted on few shapes would run away beyond them. The features (flop, gemm_bytes,
comm_bytes) are the family's (``kernels.ag_gemm.config.model_features``,
``kernels.gemm_scatter.config.model_features``).

A model file is untrusted input: read bounded, parsed as JSON only, every field checked;
anything else is a ``ValueError`` naming the file and what to do.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

FORMAT, VERSION = "workbench-choice-model", 1
MODES = ("eager", "graph")
MAX_MODEL_BYTES = 1 << 20
MAX_GROUPS, MAX_CANDIDATES = 64, 32
MIN_SHAPES = 3             # fewer fitted shapes than this and a candidate has no model in that mode
SUFFIX = ".model.json"     # beside the family's tuning table: <root>/<GPU>/<family>.model.json
TERMS = {"gemm": 3, "comm": 2}


# --------------------------------------------------------------------------
# Fitting
# --------------------------------------------------------------------------
def nnls_relative(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients >= 0 minimising sum(((X @ c - y) / y)^2): the best least-squares fit over
    every subset of columns whose solution is non-negative (exact for the <= 4 columns here)."""
    Xw, yw = X / y[:, None], np.ones_like(y)
    best, best_err = np.zeros(X.shape[1]), float(np.sum(yw ** 2))
    for r in range(1, X.shape[1] + 1):
        for cols in itertools.combinations(range(X.shape[1]), r):
            c, *_ = np.linalg.lstsq(Xw[:, cols], yw, rcond=None)
            if np.any(c < 0):
                continue
            err = float(np.sum((Xw[:, cols] @ c - yw) ** 2))
            if err < best_err - 1e-12:
                full = np.zeros(X.shape[1])
                full[list(cols)] = c
                best, best_err = full, err
    return best


def alone_times(coef: Mapping[str, list], flop, gemm_bytes, comm_bytes) -> tuple:
    """(T_gemm, T_comm) predicted by a mode's fits (arrays or scalars, ms)."""
    g, c = coef["gemm"], coef["comm"]
    return (g[0] * flop + g[1] * gemm_bytes + g[2], c[0] * comm_bytes + c[1])


def _design(t_gemm, t_comm) -> np.ndarray:
    t_gemm, t_comm = np.atleast_1d(t_gemm), np.atleast_1d(t_comm)
    return np.stack([t_gemm, t_comm, np.maximum(t_gemm, t_comm), np.ones_like(t_gemm)], axis=1)


def fit(rows, *, group_keys: list[str], gemm: str, comm: str, candidates: Mapping[str, Mapping[str, Any]],
        family: str, source: str = "", never: Callable[[dict], Mapping[str, str]] | None = None) -> dict:
    """The model from measured rows: a pandas frame with ``group_keys``, timing (eager / graph),
    variant, ms, flop, gemm_bytes, comm_bytes (the family's features) and optionally
    within_tolerance; one row per (shape, timing, method), the fit shapes only (the caller keeps
    the held-out ones apart). ``candidates``: method name -> the config it runs with. ``never``:
    a group's match -> {candidate: why} that no shape may take off the table, whatever the fitted
    shapes said (a method whose accuracy is marginal, not just once missed)."""
    groups = []
    for gkey, g in rows.groupby(group_keys):
        gkey = gkey if isinstance(gkey, tuple) else (gkey,)
        match = {k: int(v) for k, v in zip(group_keys, gkey)}
        excluded = {**_excluded(g, candidates), **{k: v for k, v in (never(match) if never else {}).items()
                                                   if k in candidates}}
        group = {"match": match, "modes": {}, "excluded": excluded,
                 "shapes": int(g[["M", "N", "K"]].drop_duplicates().shape[0]),
                 "range": {d: [int(g[d].min()), int(g[d].max())] for d in ("M", "N", "K")}}
        for mode, m in g.groupby("timing"):
            fitted = _fit_mode(m, gemm, comm, [c for c in candidates if c not in group["excluded"]])
            if fitted:
                group["modes"][str(mode)] = fitted
        if group["modes"]:
            groups.append(group)
    return {"format": FORMAT, "version": VERSION, "family": family, "source": source,
            "configs": {k: dict(v) for k, v in candidates.items()}, "groups": groups}


def _excluded(g, candidates) -> dict[str, str]:
    """Candidates that missed the tolerance on any fitted shape of the group, with why."""
    if "within_tolerance" not in g:
        return {}
    bad = g[g["within_tolerance"].astype("string").fillna("True").str.lower() == "false"]
    out = {}
    for name, b in bad.groupby("variant"):
        if name in candidates:
            n = b[["M", "N", "K"]].drop_duplicates().shape[0]
            out[str(name)] = f"outside the dtype's tolerance on {n} fitted shape(s)"
    return out


def _fit_mode(m, gemm: str, comm: str, names: list[str]) -> dict | None:
    """One mode's fits: the GEMM alone, the collective alone, then each candidate on them."""
    gm, cm = m[m["variant"] == gemm], m[m["variant"] == comm]
    if len(gm) < MIN_SHAPES or len(cm) < MIN_SHAPES:
        return None
    coef = {"gemm": nnls_relative(gm[["flop", "gemm_bytes"]].assign(one=1.0).to_numpy(float),
                                  gm["ms"].to_numpy(float)).tolist(),
            "comm": nnls_relative(cm[["comm_bytes"]].assign(one=1.0).to_numpy(float),
                                  cm["ms"].to_numpy(float)).tolist()}
    out = {**coef, "candidates": {}}
    for name in names:
        x = m[m["variant"] == name]
        if len(x) < MIN_SHAPES:
            continue
        tg, tc = alone_times(coef, x["flop"].to_numpy(float), x["gemm_bytes"].to_numpy(float),
                             x["comm_bytes"].to_numpy(float))
        out["candidates"][name] = nnls_relative(_design(tg, tc), x["ms"].to_numpy(float)).tolist()
    return out if out["candidates"] else None


# --------------------------------------------------------------------------
# Choosing
# --------------------------------------------------------------------------
def group_of(model: Mapping[str, Any], **match) -> dict | None:
    """The model's group whose fields equal ``match`` (None when it has none)."""
    for g in model.get("groups", ()):
        if all(g["match"].get(k) == v for k, v in match.items()):
            return g
    return None


def predict(group: Mapping[str, Any], mode: str, flop: float, gemm_bytes: float, comm_bytes: float) -> dict:
    """{candidate: predicted ms} in ``mode`` (eager, or graph: a capture is being served);
    a mode the group has no fit for falls back to the other one."""
    modes = group["modes"]
    fit_ = modes.get(mode) or modes[next(iter(modes))]
    tg, tc = alone_times(fit_, flop, gemm_bytes, comm_bytes)
    x = _design(tg, tc)[0]
    return {name: float(x @ np.asarray(c)) for name, c in fit_["candidates"].items()}


def choose(model: Mapping[str, Any], mode: str, features: Mapping[str, float], *, exclude=(), **match) -> str | None:
    """The candidate predicted fastest for a problem (its ``features``: flop, gemm_bytes,
    comm_bytes) in ``mode``, among those of the group ``match`` names and not in ``exclude``;
    None without one."""
    group = group_of(model, **match)
    if group is None:
        return None
    times = predict(group, mode, features["flop"], features["gemm_bytes"], features["comm_bytes"])
    times = {k: v for k, v in times.items() if k not in group.get("excluded", {}) and k not in exclude}
    return min(sorted(times), key=times.get) if times else None


# --------------------------------------------------------------------------
# Files (untrusted)
# --------------------------------------------------------------------------
def path_for(root: Path, device: Mapping[str, str], family: str) -> Path:
    """Where a family's model for a GPU lives under a tables root (beside its tuning table)."""
    from kernels.common.tables import device_slug

    return Path(root) / device_slug(device["name"]) / f"{family}{SUFFIX}"


def save(path: Path, model: Mapping[str, Any]) -> Path:
    """Write a model atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(model, fh, indent=1, sort_keys=True)
    os.chmod(tmp, 0o644)   # mkstemp's 0600 would hide a shipped or shared model from other users
    os.replace(tmp, path)
    return path


def load(path: Path, family: str) -> dict | None:
    """A model file checked (None when there is none); ValueError naming the file otherwise."""
    path = Path(path)
    if not path.is_file():
        return None
    with open(path, "rb") as fh:
        raw = fh.read(MAX_MODEL_BYTES + 1)
    what = (f"choice model {path}: delete it, or fit it again (python3 experiments/run_overlap.py --refit "
            f"--out <a run's folder>)")
    if len(raw) > MAX_MODEL_BYTES:
        raise ValueError(f"{what}; it is larger than {MAX_MODEL_BYTES} bytes")
    try:
        model = json.loads(raw.decode("utf-8"))
        check(model, family)
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError, AttributeError, ValueError) as exc:
        raise ValueError(f"{what}; it is not one ({type(exc).__name__}: {str(exc)[:200]})") from None
    return model


def check(model: Any, family: str) -> None:
    """Raise ValueError (or TypeError / KeyError) unless ``model`` is a well-formed model of ``family``."""
    if not isinstance(model, dict) or model.get("format") != FORMAT or model.get("version") != VERSION:
        raise ValueError(f"not a {FORMAT} version {VERSION}")
    if model.get("family") != family:
        raise ValueError(f"a model of {model.get('family')!r}, not of {family!r}")
    configs, groups = model["configs"], model["groups"]
    if not isinstance(configs, dict) or not all(isinstance(v, dict) for v in configs.values()):
        raise ValueError("configs must map candidate names to config objects")
    if not isinstance(groups, list) or len(groups) > MAX_GROUPS:
        raise ValueError(f"groups must be a list of at most {MAX_GROUPS}")
    for g in groups:
        if not all(isinstance(v, int) for v in g["match"].values()) or not isinstance(g.get("excluded", {}), dict):
            raise ValueError("a group's match fields must be integers and its excluded a mapping")
        for mode, f in g["modes"].items():
            if mode not in MODES or len(f["candidates"]) > MAX_CANDIDATES:
                raise ValueError(f"mode {mode!r} (must be one of {MODES}, at most {MAX_CANDIDATES} candidates)")
            for name, n in TERMS.items():
                _coefs(f[name], n, name)
            for name, c in f["candidates"].items():
                if name not in configs:
                    raise ValueError(f"candidate {name!r} has no config")
                _coefs(c, 4, name)


def _coefs(c: Any, n: int, what: str) -> None:
    if not (isinstance(c, list) and len(c) == n and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                         and math.isfinite(x) and x >= 0 for x in c)):
        raise ValueError(f"{what}: coefficients must be {n} finite numbers >= 0")


_LOADED: dict = {}   # (path, mtime, size) -> model or None: a file is read once per version


def lookup(family: str, device: Mapping[str, str] | None) -> tuple[dict | None, str]:
    """This GPU's model of ``family`` (the user's tables root over the shipped one) and its
    path; (None, '') without one. A broken file is said once and passed over."""
    if device is None:
        return None, ""
    from kernels.common import tables

    for root in (tables.user_root(), tables.SHIPPED_ROOT):
        path = path_for(root, device, family)
        try:
            st = path.stat()
        except OSError:
            continue
        key = (str(path), st.st_mtime_ns, st.st_size)
        if key not in _LOADED:
            try:
                _LOADED[key] = load(path, family)
            except (OSError, ValueError) as exc:
                tables.warn_once(path, "choice model", str(exc))
                _LOADED[key] = None
        if _LOADED[key] is not None:
            return _LOADED[key], str(path)
    return None, ""


def merge(models: list[Mapping[str, Any]], source: str = "") -> dict:
    """One model of several runs' (each fitted on its own world size): their groups, a later
    run's group replacing an earlier one of the same match, their candidates' configs."""
    if not models:
        raise ValueError("merge: no model given")
    family = models[0]["family"]
    if any(m["family"] != family for m in models):
        raise ValueError(f"merge: models of several families {sorted({m['family'] for m in models})}")
    groups: dict = {}
    configs: dict = {}
    for m in models:
        configs.update(m["configs"])
        for g in m["groups"]:
            groups[tuple(sorted(g["match"].items()))] = g
    return {"format": FORMAT, "version": VERSION, "family": family, "configs": configs,
            "groups": list(groups.values()), "source": source or "; ".join(m.get("source", "") for m in models)}

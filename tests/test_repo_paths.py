"""Every file the READMEs and the study notebooks name is in the tree (or, for a superseded run,
in the commit the README names with ``git show <commit>:<path>``).

CPU only, no notebook stack: the READMEs are read as text, the notebooks as JSON.
"""
from __future__ import annotations

import fnmatch
import json
import re
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOP = ("results/", "experiments/", "kernels/", "notebooks/", "tests/", "workbench/")
GENERATED = ("results/reports/", "results/fresh/", "wheelhouse/", ".node-site/")   # written by runs, never committed
# Outputs a run writes where it applies, named as such (not committed: no 8-GPU run yet; the trace as parquet).
NOT_COMMITTED = {"results/ag_gemm/README.md": {"w8/", "trace.csv"},
                 "notebooks/05_all_gather_gemm.ipynb": {"results/ag_gemm/w8/", "trace.csv"},
                 # written by experiments/run_moe_mxfp4.py on a GPU, not yet run: the notebook says so
                 "notebooks/07_moe_mxfp4.ipynb": {"gpt-oss-120b/rows.csv", "gpt-oss-20b/rows.csv"}}
EXTENSIONS = {".csv", ".parquet", ".json", ".md", ".txt", ".log", ".yaml", ".py", ".ipynb"}
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
GIT_SHOW = re.compile(r"git show ([0-9a-f]{7,40}):([\w./-]+)")
SCRIPT = re.compile(r"^(?:experiments|tests|notebooks|kernels|workbench)/[\w./-]+\.(?:py|yaml|ipynb|txt)$")
READMES = sorted([REPO / "README.md", *(REPO / "results").glob("README.md"), *(REPO / "results").glob("*/README.md"),
                  *(REPO / "experiments").glob("README.md")])
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9]*.ipynb"))


def _expand_braces(token: str) -> list[str]:
    """'final_{host,device}.csv' -> both names (one group; a group without a comma is a placeholder)."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m or "," not in m.group(1):
        return [token]
    return [token[:m.start()] + alt + token[m.end():] for alt in m.group(1).split(",")]


def _is_path(token: str) -> bool:
    if any(c in token for c in "<>$~@ ") or token.startswith(("/", "-", "http")) or "{" in token and "," not in token:
        return False
    if re.match(r"[A-Z_]+/", token):  # a placeholder folder: DIR/ceilings.json, OUT/...
        return False
    return (token.startswith(TOP) or token.startswith("../") or token.endswith("/")
            or Path(token.rstrip("/")).suffix in EXTENSIONS)


def _exists(path: Path) -> bool:
    text = str(path)
    if any(c in text for c in "*?["):
        return any(path.parent.glob(path.name)) if not any(c in str(path.parent) for c in "*?[") else \
            any(REPO.glob(str(path.relative_to(REPO))))
    return path.exists()


def _found(token: str, base: Path) -> bool:
    """A path from the repository root (results/...), relative to the README (../ceilings/...), or a name
    the README uses for a file of its own folder's tree (`gaps/tail.csv`, `summary.md`); scripts and
    specs (`run_ag_gemm.py`) anywhere in the repository."""
    token = token.split("::")[0]
    if token.startswith(TOP):
        return _exists(REPO / token)
    if _exists(base / token):
        return True
    if token.startswith("../"):
        return False
    pattern = "*/" + token.rstrip("/")
    roots = [base] + ([REPO / "experiments", REPO / "tests", REPO / "notebooks"]
                      if Path(token).suffix in (".py", ".yaml", ".ipynb") else [])
    return any(fnmatch.fnmatch(str(p), pattern) and (p.is_dir() or not token.endswith("/"))
               for root in roots for p in _tree(root))


@lru_cache(maxsize=None)
def _tree(root: Path) -> tuple[Path, ...]:
    return tuple(p for p in root.rglob("*") if ".git" not in p.parts and ".venv" not in p.parts)


def _in_history(rel: str, token: str, base: Path, history: dict[str, str]) -> bool:
    """The README cites the file with `git show`: by its path, or by a name (or pattern) of its folder's tree."""
    if rel in history:
        return True
    folder = str(base.resolve().relative_to(REPO)) + "/"
    return not token.startswith(("../", *TOP)) and any(
        h.startswith(folder) and fnmatch.fnmatch(h, "*/" + token) for h in history)


@lru_cache(maxsize=None)
def _in_git(sha: str, path: str) -> bool | None:
    """True/False when this checkout knows the commit; None when it cannot tell (no git, shallow clone)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
    try:
        if git("cat-file", "-e", f"{sha}^{{commit}}").returncode != 0:
            return None
        return git("cat-file", "-e", f"{sha}:{path}").returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None


def readme_paths(text: str) -> tuple[list[str], list[str]]:
    """(paths named in inline code, scripts named in commands) of a markdown text."""
    fenced = "\n".join(m.group(0) for m in FENCE.finditer(text))
    prose = FENCE.sub("", text)
    named, scripts = [], []
    for span in CODE_SPAN.findall(prose):
        span = span.strip()
        if " " in span:  # a command: check the scripts and specs it runs
            scripts += [w for w in span.split() if SCRIPT.match(w)]
        elif _is_path(span):
            named += _expand_braces(span)
    scripts += [w for w in fenced.split() if SCRIPT.match(w)]
    return named, scripts


@pytest.mark.parametrize("readme", READMES, ids=[str(p.relative_to(REPO)) for p in READMES])
def test_readme_names_only_files_that_exist(readme):
    text = readme.read_text(encoding="utf-8")
    history = {}
    for sha, path in GIT_SHOW.findall(text):
        assert _in_git(sha, path) is not False, f"{readme.name}: `git show {sha}:{path}`: no such file in that commit"
        history[path] = sha
    named, scripts = readme_paths(GIT_SHOW.sub("", text))
    allowed = NOT_COMMITTED.get(str(readme.relative_to(REPO)), set())
    missing = []
    for token in named:
        path = (REPO / token) if token.startswith(TOP) else (readme.parent / token)
        rel = str(path.resolve().relative_to(REPO)) if path.resolve().is_relative_to(REPO) else str(path)
        if rel.startswith(GENERATED) or token.startswith(GENERATED) or token in allowed \
                or _in_history(rel, token, readme.parent, history) or _found(token, readme.parent):
            continue
        missing.append(token)
    missing += [s for s in scripts if not (REPO / s).exists()]
    assert not missing, (f"{readme.relative_to(REPO)} names files that are not in the tree (a superseded run: "
                         f"cite it as `git show <commit>:<path>`): {sorted(set(missing))}")


def _study_folders() -> list[str]:
    """The folders under results/ that hold committed results: not what a run writes there
    (``make report`` writes results/reports/ first thing in a fresh clone)."""
    return sorted(p.name for p in (REPO / "results").iterdir()
                  if p.is_dir() and not f"results/{p.name}/".startswith(GENERATED))


def test_results_readmes_say_how_a_run_is_added():
    text = (REPO / "results" / "README.md").read_text(encoding="utf-8")
    assert "git show" in text and "README.md" in text
    for study in _study_folders():
        assert f"`{study}/`" in text, f"results/README.md does not list {study}/"


def test_generated_output_is_not_taken_for_a_study():
    """README's two commands in order: `make report` writes results/reports/ (ignored by git), then
    `make test` must still pass: generated output is no study folder."""
    made = not (REPO / "results" / "reports").exists()
    (REPO / "results" / "reports").mkdir(exist_ok=True)
    try:
        assert "reports" not in _study_folders()
        ignored = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", "results/reports/index.html"],
                                 capture_output=True)
        assert ignored.returncode in (0, 128), "results/reports/ must stay ignored by git"
    finally:
        if made:
            (REPO / "results" / "reports").rmdir()


def _notebook_sources(nb: Path) -> list[tuple[str, str]]:
    cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
    return [(c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list) else c["source"]) for c in cells]


REPO_PATH = re.compile(r"(?<![\w/.{])((?:results|experiments|kernels|notebooks|tests|workbench)/[\w./*-]*)")
DATA_NAME = re.compile(r"[\"']([\w./-]+\.(?:csv|parquet|json))[\"']")


@lru_cache(maxsize=None)
def _committed_data() -> tuple[str, ...]:
    return tuple(str(p.relative_to(REPO / "results")) for p in (REPO / "results").rglob("*")
                 if p.is_file() and not str(p.relative_to(REPO)).startswith(GENERATED))


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_names_only_files_that_exist(nb):
    """Repository paths anywhere in the notebook, and the data files its code reads by name (each must be
    committed somewhere under results/, e.g. "gaps/tail.csv" as results/gemm_zoo/gaps/tail.csv)."""
    allowed = NOT_COMMITTED.get(f"notebooks/{nb.name}", set())
    missing = []
    for kind, src in _notebook_sources(nb):
        for token in REPO_PATH.findall(src):
            token = token.rstrip(".")
            if token.startswith(GENERATED) or "{" in token or token in allowed:
                continue
            if not _exists(REPO / token):
                missing.append(token)
        if kind != "code":
            continue
        for name in DATA_NAME.findall(src):
            if name in allowed:
                continue
            if not any(f == name or f.endswith("/" + name) or fnmatch.fnmatch(f, "*" + name) for f in _committed_data()):
                missing.append(name)
    assert not missing, f"{nb.name} names files that are not in the tree: {sorted(set(missing))}"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_cells_carry_ids_and_tag_their_setup(nb):
    """Cell ids (nbformat 4.5: without them every run of `make report` warns), the setup cells a report
    folds (workbench.report_layout: at least the parameters and the imports) and the findings it shows first."""
    data = json.loads(nb.read_text(encoding="utf-8"))
    assert (data["nbformat"], data["nbformat_minor"]) >= (4, 5)
    ids = [c.get("id") for c in data["cells"]]
    assert all(ids) and len(set(ids)) == len(ids), f"{nb.name}: cells without an id or with a repeated one"
    tags = [set(c.get("metadata", {}).get("tags", [])) for c in data["cells"]]
    setup = [i for i, t in enumerate(tags) if "setup" in t]
    assert any("parameters" in tags[i] for i in setup) and len(setup) >= 2, f"{nb.name}: setup cells {setup}"
    assert all(data["cells"][i]["cell_type"] == "code" for i in setup)
    assert any("findings" in t for t in tags), f"{nb.name}: no cell tagged findings"


def test_readme_cluster_example_spec_loads_as_the_console_script_would():
    """README's cluster example, `workbench sweep tests/cluster/toy.yaml ...` from the repository
    root: a console script's import path lacks the working directory that `python -m` adds, so
    the spec's kernel module (tests.cluster.toy) is found relative to the spec or the working
    directory. Checked in an isolated interpreter (-I: no working directory, no PYTHONPATH)."""
    import sys

    code = ("import sys, os; assert os.getcwd() not in sys.path and '' not in sys.path; "
            "from workbench.spec import load_spec; s = load_spec('tests/cluster/toy.yaml', quick=True); "
            "print(s.kernel, s.module.__name__)")
    r = subprocess.run([sys.executable, "-I", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    if "No module named 'workbench'" in r.stderr:
        pytest.skip("the workbench package is not installed here (pip install -e .), only on PYTHONPATH")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["tests.cluster.toy", "tests.cluster.toy"]

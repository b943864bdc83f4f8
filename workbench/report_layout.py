"""What a study report shows first: its findings; and what it folds away: its setup.

A notebook marks cells with tags (cell metadata ``tags``, as papermill's ``parameters``):

``setup``
    the plumbing a reader of the report does not need first: parameters, imports, where the data
    come from. Each run of consecutive setup cells (papermill's ``injected-parameters`` cell joins
    its neighbours) is folded into one closed ``<details>`` in the HTML.
``findings``
    the cells that state what the study found. The HTML shows them again right after the
    notebook's first (title) cell, in a box naming the section they come from; code cells there
    show their output only.

`arrange` changes the notebook the HTML is rendered from (a copy): the executed notebook keeps
every cell, in its order. The template (``workbench.report``) turns the ``wb_*`` metadata set here
into the box and the folds.
"""
from __future__ import annotations

import copy
import html
import re
from typing import Any

from .datasource import META_KEY

SETUP_TAG = "setup"
FINDINGS_TAG = "findings"
FOLD_TAGS = {SETUP_TAG, "injected-parameters"}
# Outputs a copy must not repeat: a figure or widget drawn twice would share its element ids.
_NOT_COPIED = ("application/vnd.plotly.v1+json", "application/vnd.jupyter.widget-view+json")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")

CSS = """
.wb-setup { margin: 4px 16px 4px 12px; padding: 2px 8px; border-left: 3px solid #bbb; }
.wb-setup > summary { cursor: pointer; color: #555; font-size: 13px; padding: 2px 0; }
.wb-findings { margin: 8px 16px 16px; padding: 4px 8px 8px; border: 1px solid #2e7d32; border-radius: 4px;
  background: #f4f9f4; }
.wb-findings-head { font-family: var(--jp-ui-font-family, sans-serif); font-size: 15px; font-weight: bold;
  margin: 4px 8px; }
.wb-findings-head span { font-weight: normal; font-size: 13px; color: #555; }
"""


def _tags(cell) -> set[str]:
    return set((cell.get("metadata") or {}).get("tags") or [])


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else str(src)


def _heading(cell) -> str | None:
    if cell.get("cell_type") != "markdown":
        return None
    for line in _source(cell).splitlines():
        m = _HEADING.match(line)
        if m:
            return m.group(2).strip()
    return None


def _section_of(cells: list, index: int) -> str:
    """The heading of the cell, else of the nearest markdown cell above it."""
    for cell in reversed(cells[:index + 1]):
        title = _heading(cell)
        if title:
            return title
    return "this report"


def _finding_copy(cell) -> Any:
    """A copy of a findings cell for the box: headings as bold lines (no second anchor), code as its output."""
    c = copy.deepcopy(cell)
    if c.get("id"):
        c["id"] = f"{c['id'][:55]}-findings"  # cell ids are unique in a notebook
    meta = c.setdefault("metadata", {})
    meta["tags"] = [t for t in meta.get("tags", []) if t not in (FINDINGS_TAG, *FOLD_TAGS)]
    if c.get("cell_type") == "markdown":
        c["source"] = "\n".join(f"**{m.group(2)}**" if (m := _HEADING.match(line)) else line
                                for line in _source(c).splitlines())
    elif c.get("cell_type") == "code":
        meta["transient"] = {"remove_source": True}
        kept: list = []
        for o in c.get("outputs") or []:
            if not any(k in (o.get("data") or {}) for k in _NOT_COPIED):
                kept.append(o)
            elif kept and _is_data_label(kept[-1]):
                kept.pop()  # the label of the figure left out
        c["outputs"] = kept
    return c


def _is_data_label(output) -> bool:
    meta = (output.get("metadata") or {}).get(META_KEY)
    return isinstance(meta, dict) and meta.get("kind") == "data"


def _mark_findings(cells: list) -> list:
    found = [i for i, c in enumerate(cells) if FINDINGS_TAG in _tags(c)]
    if not found:
        return cells
    copies = [_finding_copy(cells[i]) for i in found]
    sections = list(dict.fromkeys(_section_of(cells, i) for i in found))
    named = ", ".join(f"\u201c{html.escape(s)}\u201d" for s in sections)
    copies[0]["metadata"]["wb_box_open"] = (
        f'<section class="wb-findings"><div class="wb-findings-head">Findings '
        f"<span>(also in {named}, further down)</span></div>")
    copies[-1]["metadata"]["wb_box_close"] = True
    at = 1 if cells and cells[0].get("cell_type") == "markdown" else 0
    return cells[:at] + copies + cells[at:]


def _mark_folds(cells: list) -> None:
    i = 0
    while i < len(cells):
        if not _tags(cells[i]) & FOLD_TAGS:
            i += 1
            continue
        j = i
        while j + 1 < len(cells) and _tags(cells[j + 1]) & FOLD_TAGS:
            j += 1
        n = j - i + 1
        cells[i].setdefault("metadata", {})["wb_fold_open"] = (
            f"Setup: parameters, imports, where the data come from ({n} cell{'s' if n > 1 else ''}, "
            "folded; the executed notebook has them)")
        cells[j].setdefault("metadata", {})["wb_fold_close"] = True
        i = j + 1


def arrange(nb) -> None:
    """Findings first, setup folded: in place, on the notebook the HTML is rendered from."""
    nb.cells = _mark_findings(list(nb.cells))
    _mark_folds(nb.cells)

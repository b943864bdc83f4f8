"""Find and read compiled kernels in the Triton cache.

A Triton cache is a directory of entries, one directory per compiled
specialization, named by a hash. A healthy entry holds `NAME.json` (the
compile metadata), one file per stage (`NAME.ttir`, `NAME.ptx`, ...) and
`__grp__NAME.json` (written last, listing the files). Anything else is
reported as a problem of that entry, with what to do, and listing goes on.

Listing reads only the small JSON files; assembly is read when asked for.
Nothing here executes or unpickles cache content, and nothing writes to it.
Every read is bounded (`reading`: size caps, no FIFOs or devices, no
symlinks out of the entry) and the tool runs of one request on an entry
(its SASS, its resources) share one deadline (`tools.Deadline`); what is
refused becomes a problem of the entry.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import stat
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from . import reading

# Stage files Triton writes, by extension. `source` is Triton's front-end IR
# (TTIR for @triton.jit, the Gluon IR for @gluon.jit); `python` is the kernel's
# Python text, found through that IR's location info; `sass` is disassembled
# from the cubin on demand.
TEXT_STAGES = ("source", "ttir", "ttgir", "llir", "ptx", "amdgcn")
BINARY_STAGES = ("cubin", "hsaco")
ALL_STAGES = ("python",) + TEXT_STAGES + ("sass",)
STAGE_ALIASES = {"gluon": "source", "py": "python", "gcn": "amdgcn"}
# Files a Triton cache holds that are not kernels (compiled launchers, driver helpers).
# Written beside an entry by `workbench asm compile` only: the call that made it.
SIDECAR = ".workbench.json"
_AUX_SUFFIXES = (".so", ".c", ".cpp", ".h", ".pyd", ".dll", ".dylib")
MAX_DIR_NAMES = 10_000  # names looked at in one entry directory (a real one has about ten)


class CacheError(Exception):
    """A problem the user can act on; the message says what to do."""


def cache_dir(explicit: str | os.PathLike | None = None, *, create: bool = False) -> Path:
    """The cache: `explicit`, else $TRITON_CACHE_DIR, else ~/.triton/cache (made if `create`)."""
    if explicit:
        path = Path(explicit).expanduser()
    elif os.environ.get("TRITON_CACHE_DIR"):
        path = Path(os.environ["TRITON_CACHE_DIR"]).expanduser()
    else:
        path = Path.home() / ".triton" / "cache"
    if create:
        path.mkdir(parents=True, exist_ok=True)
    if not path.is_dir():
        raise CacheError(
            f"no Triton cache at {path}: run a kernel, or `workbench asm compile`, "
            "or point --cache / $TRITON_CACHE_DIR at a cache directory"
        )
    return path


_REDO = ": delete the entry and re-compile"


def _read_json(path: Path, root: Path | None = None, max_bytes: int | None = None) -> tuple[dict | None, str | None]:
    """(the JSON object, None) or (None, what is wrong and what to do)."""
    limit = min(reading.MAX_JSON_BYTES, reading.max_file_bytes(max_bytes))
    try:
        data = json.loads(reading.read_bytes(path, limit, root, hint="a Triton JSON file is a few kB: delete the entry"))
    except FileNotFoundError:
        return None, f"{path.name} is missing{_REDO}"
    except reading.Refused as exc:
        return None, str(exc)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        return None, f"{path.name} is unreadable ({type(exc).__name__}: {str(exc)[:200]}){_REDO}"
    if not isinstance(data, dict):
        return None, f"{path.name} is not a JSON object{_REDO}"
    return data, None


@dataclass
class Entry:
    """One compiled specialization: a directory of the cache."""

    path: Path
    name: str = ""
    metadata: dict = field(default_factory=dict)
    stages: dict[str, Path] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    mtime: float = 0.0
    max_bytes: int | None = None  # read cap of one stage file (None: reading.max_file_bytes())
    _location_refused = None  # why the IR holding the location info was not read (not a field)

    @property
    def cap(self) -> int:
        return reading.max_file_bytes(self.max_bytes)

    def tool_deadline(self):
        """A fresh time budget shared by the tool runs (cuobjdump, nvdisasm) of one request on this entry."""
        from .tools import Deadline

        return Deadline()

    def _refused(self, exc: OSError) -> CacheError:
        """Record a refused read as a problem of the entry; the error to raise."""
        msg = str(exc)
        if msg not in self.problems:
            self.problems.append(msg)
        return CacheError(f"{self.path}: {msg}")

    # -- identity ---------------------------------------------------------
    @property
    def hash(self) -> str:
        return self.path.name

    @property
    def target(self) -> dict:
        t = self.metadata.get("target")
        return t if isinstance(t, dict) else {}

    @property
    def backend(self) -> str:
        return str(self.target.get("backend") or self.metadata.get("backend_name") or "?")

    @property
    def arch(self) -> str:
        a = self.target.get("arch", self.metadata.get("arch", "?"))
        return f"sm{a}" if isinstance(a, int) else str(a)

    @property
    def num_warps(self):
        return self.metadata.get("num_warps")

    @property
    def num_stages(self):
        return self.metadata.get("num_stages")

    @property
    def shared(self):
        return self.metadata.get("shared")

    @property
    def triton_version(self):
        return self.metadata.get("triton_version")

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def final_stage(self) -> str:
        """The assembly the GPU runs: PTX on NVIDIA, AMDGCN on AMD."""
        return "amdgcn" if "amdgcn" in self.stages or self.backend == "hip" else "ptx"

    def summary(self) -> dict:
        """The row `ls` prints: only metadata, no assembly read."""
        return {
            "hash": self.hash,
            "name": self.name,
            "backend": self.backend,
            "arch": self.arch,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "shared": self.shared,
            "triton_version": self.triton_version,
            "stages": sorted(self.stages),
            "mtime": self.mtime,
            "path": str(self.path),
            "problems": list(self.problems),
        }

    # -- stages -------------------------------------------------------------
    def text(self, stage: str) -> str:
        """The text of one stage; CacheError (naming the file) if it cannot be had."""
        stage = normalize_stage(stage)
        if stage == "python":
            return self._python_source()
        if stage == "sass":
            from .tools import sass_from_cubin

            path = self._stage_path("cubin")
            try:
                reading.check_file(path, self.cap, self.path)
            except reading.Refused as exc:
                raise self._refused(exc) from None
            return sass_from_cubin(path, self.tool_deadline(), self.cap)
        path = self._stage_path(stage)
        try:
            return reading.read_text(path, self.cap, self.path)
        except reading.Refused as exc:
            raise self._refused(exc) from None
        except OSError as exc:
            raise CacheError(f"{path}: cannot read ({exc}); the entry may be damaged, re-compile it") from exc

    def _stage_path(self, stage: str) -> Path:
        if stage not in self.stages:
            have = ", ".join(sorted(self.stages)) or "none"
            raise CacheError(
                f"{self.path}: no {stage} stage in this entry (it has: {have}); "
                f"{'it was compiled for ' + self.backend if self.stages else 're-compile the kernel'}"
            )
        return self.stages[stage]

    @cached_property
    def location(self) -> tuple[str, int] | None:
        """(python file, line) of the kernel, from the front-end IR's location info."""
        path = self.stages.get("source") or self.stages.get("ttir")
        if path is None:
            return None
        try:
            reading.check_file(path, self.cap, self.path)  # a file over the cap is not read, not even its head
            head = reading.read_text(path, 4096, self.path, head=True)
        except reading.Refused as exc:
            self._location_refused = str(exc)
            return None
        except OSError:
            return None
        m = re.search(r'^#loc\d* = loc\("([^"]+)":(\d+):\d+\)', head, re.M)
        return (m.group(1), int(m.group(2))) if m else None

    def _python_source(self) -> str:
        loc = self.location
        if loc is None:
            raise CacheError(f"{self.path}: no location info in the IR ({self._location_refused or 'none found'}), "
                             "so the Python source cannot be found")
        file, line = loc
        if not file.endswith(".py"):
            raise CacheError(f"{self.path}: the IR names {file!r} as the kernel's source, which is not a .py "
                             "file: not read; the `source` stage has Triton's IR of it")
        try:
            path = find_source_file(file)
            lines = reading.read_text(path, min(reading.MAX_SOURCE_BYTES, self.cap)).splitlines()
        except reading.Refused as exc:
            raise CacheError(f"{self.path}: the kernel's source file {file}: {exc}") from None
        except OSError:
            raise CacheError(
                f"{self.path}: the kernel's source file {file} is not readable here "
                "(compiled on another machine?); the `source` stage has Triton's IR of it"
            ) from None
        if not 1 <= line <= len(lines):
            raise CacheError(f"{self.path}: the IR places the kernel at line {line} of {file}, which has "
                             f"{len(lines)} lines (the file changed since?); the `source` stage has the IR")
        return _function_block(lines, line - 1)

    def mix(self, stage: str | None = None, text: str | None = None):
        """Instruction mix (pandas DataFrame) of `stage`, default the final assembly.

        `text`: the stage's text when the caller has read it already.
        A truncated file is classified as far as it goes and noted in `problems`.
        """
        from .isa import isa_of_stage, mix

        stage, text = self._assembly(stage, text)
        return mix(text, isa_of_stage(stage))

    def opcodes(self, stage: str | None = None, text: str | None = None):
        """Instructions per opcode (pandas DataFrame, ``isa.opcodes``) of `stage`, default the
        final assembly; arithmetic and bit operations included, which ``mix`` leaves in 'other'.
        `text` and truncation as for ``mix``."""
        from .isa import isa_of_stage, opcodes

        stage, text = self._assembly(stage, text)
        return opcodes(text, isa_of_stage(stage))

    def _assembly(self, stage: str | None, text: str | None) -> tuple[str, str]:
        """(stage, its text), a truncated text noted in `problems`."""
        stage = normalize_stage(stage or self.final_stage)
        text = self.text(stage) if text is None else text
        problem = truncation_problem(stage, text)
        if problem and problem not in self.problems:
            self.problems.append(problem)
        return stage, text

    def resources(self) -> dict:
        from .resources import resources

        return resources(dict(self.stages), self.metadata, root=self.path, max_bytes=self.cap,
                         deadline=self.tool_deadline())

    def specialization(self) -> dict:
        """What makes this specialization: options, argument attributes, IR constants."""
        return specialization(self)


# What a complete file of each stage holds near its end; a file cut short lacks it.
_COMPLETE_MARKS = {"ptx": re.compile(r"}\s*$"), "amdgcn": re.compile(r"\.end_amdgpu_metadata")}


def truncation_problem(stage: str, text: str) -> str | None:
    """A note if `text` of `stage` looks cut short (a compile or copy interrupted)."""
    mark = _COMPLETE_MARKS.get(stage)
    if mark is None or mark.search(text):
        return None
    return (f"{stage} looks truncated (it lacks the end a complete {stage} file has); "
            "counts cover only what is there: delete the entry and re-compile")


def find_source_file(file: str) -> Path:
    """`file` itself, else the same relative path under the working or repo directory.

    Entries compiled in another checkout (or machine) name that checkout's path.
    """
    path = Path(file)
    if path.exists():
        return path
    parts = path.parts
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        for i in range(1, len(parts)):
            candidate = root.joinpath(*parts[i:])
            if candidate.is_file():
                return candidate
    return path


def _function_block(lines: list[str], start: int) -> str:
    """The decorated function starting near `start` (0-based), by indentation."""
    # Walk back over decorators to include them.
    while start > 0 and lines[start - 1].lstrip().startswith("@"):
        start -= 1
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and not lines[end].lstrip().startswith("def "):
        end += 1  # skip decorator lines down to the def
    end += 1
    while end < len(lines):
        text = lines[end]
        if text.strip() and len(text) - len(text.lstrip()) <= indent:
            break
        end += 1
    return "\n".join(lines[start:end]).rstrip() + "\n"


def normalize_stage(stage: str) -> str:
    s = STAGE_ALIASES.get(stage.lower(), stage.lower())
    if s not in ALL_STAGES:
        raise CacheError(f"unknown stage {stage!r}: choose one of {', '.join(ALL_STAGES)}")
    return s


# -- reading one entry -------------------------------------------------------


def _entry_files(path: Path) -> tuple[dict[str, Path], set[str], list[str]]:
    """The regular files of an entry directory (symlinks inside it followed), the names refused, and why."""
    files: dict[str, Path] = {}
    refused: set[str] = set()
    problems: list[str] = []
    with os.scandir(path) as it:
        for d in itertools.islice(it, MAX_DIR_NAMES + 1):
            if len(files) + len(problems) >= MAX_DIR_NAMES:
                problems.append(f"more than {MAX_DIR_NAMES:,} names in the directory: the rest was not looked "
                                "at (a Triton entry holds about ten files); delete it if no tool owns it")
                break
            try:
                if d.is_symlink() and not reading.inside(d.path, path):
                    refused.add(d.name)
                    problems.append(f"{d.name} is a symlink leading out of the entry (to "
                                    f"{os.path.realpath(d.path)}): not read; delete it")
                    continue
                mode = os.stat(d.path).st_mode
            except OSError as exc:
                problems.append(f"{d.name} cannot be examined ({exc.strerror or exc}); check it")
                continue
            if stat.S_ISREG(mode):
                files[d.name] = Path(d.path)
            elif not stat.S_ISDIR(mode):  # FIFOs, sockets, devices: never opened
                refused.add(d.name)
                problems.append(f"{d.name} is {reading.kind_of(mode)}, not a regular file: not read; delete it")
    return files, refused, problems


def read_entry(path: str | os.PathLike, max_bytes: int | None = None, root: str | os.PathLike | None = None) -> Entry:
    """Read one entry directory's metadata (never its assembly).

    `max_bytes`: read cap of one stage file (default `reading.max_file_bytes()`);
    `root`: the cache, which the entry (a symlink, maybe) must not leave.
    """
    path = Path(path)
    entry = Entry(path=path, max_bytes=max_bytes)
    if root is not None and not reading.inside(path, root):
        entry.problems.append(f"a symlink leading out of the cache (to {os.path.realpath(path)}): not read; "
                              "delete it, or copy the entry into the cache")
        return entry
    try:
        files, refused_names, refused = _entry_files(path)
        entry.mtime = path.stat().st_mtime
    except OSError as exc:
        entry.problems.append(f"cannot read directory ({exc}); check permissions")
        return entry
    entry.problems.extend(refused)
    if path.name.startswith("tmp."):
        entry.problems.append(
            "half-written entry (a tmp.* directory: a compile was interrupted or is running); "
            "delete it once no compile is running"
        )
    groups = [n for n in files if n.startswith("__grp__") and n.endswith(".json")]
    metas = [n for n in files if n.endswith(".json") and not n.startswith("__grp__") and not n.endswith(SIDECAR)]
    if groups:
        entry.name = groups[0][len("__grp__"):-len(".json")]
    elif metas:
        entry.name = metas[0][: -len(".json")]
    else:
        stems = {Path(n).stem for n in files}
        entry.name = stems.pop() if len(stems) == 1 else ""
    if not files:
        entry.problems.append("empty directory; delete it")
        return entry
    if not groups and not metas:
        entry.problems.append(
            f"not a Triton kernel entry (files: {', '.join(sorted(files))[:120]}); "
            "leave it if another tool owns it, else delete it"
        )
        return entry
    if not groups:
        entry.problems.append(
            "no __grp__ file: the compile did not finish writing this entry; delete the directory and re-compile"
        )
    meta, err = _read_json(path / f"{entry.name}.json", path, max_bytes)
    if meta is not None:
        entry.metadata = meta
    elif f"{entry.name}.json" not in refused_names:
        entry.problems.append(f"metadata {err}")
    for fname, fpath in files.items():
        stem, dot, ext = fname.partition(".")
        if stem == entry.name and ext in TEXT_STAGES + BINARY_STAGES:
            entry.stages[ext] = fpath
    if groups:
        grp, err = _read_json(path / groups[0], path, max_bytes)
        listed = grp.get("child_paths", {}) if grp else {}
        if not err and not isinstance(listed, dict):
            err = f"has no child_paths mapping{_REDO}"
        if err:
            entry.problems.append(f"group file {err}")
        else:
            missing = sorted(n for n in listed if n not in files and n not in refused_names)
            if missing:
                entry.problems.append(
                    f"files listed by the group file are missing: {', '.join(missing[:10])}"
                    f"{f' and {len(missing) - 10} more' if len(missing) > 10 else ''}; "
                    "delete the entry and re-compile"
                )
    for ext in ("ptx", "amdgcn", "cubin", "hsaco"):
        p = entry.stages.get(ext)
        if p is not None and _size(p) == 0:
            entry.problems.append(f"{p.name} is empty: delete the entry and re-compile")
    return entry


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return -1


def _is_aux_dir(path: Path) -> bool:
    """Directories of compiled launchers / driver helpers: part of a healthy cache."""
    try:
        names = [p.name for p in itertools.islice(path.iterdir(), MAX_DIR_NAMES)]
    except OSError:
        return False
    return bool(names) and all(n.endswith(_AUX_SUFFIXES) or n.startswith("__grp__") for n in names) and any(
        n.endswith(_AUX_SUFFIXES) for n in names
    )


def list_entries(cache: str | os.PathLike | None = None, max_bytes: int | None = None) -> list[Entry]:
    """Every entry of the cache, newest first; damaged ones carry `problems`.

    `max_bytes`: read cap of one stage file (default `reading.max_file_bytes()`).
    """
    root = cache_dir(cache)
    entries = []
    for child in root.iterdir():
        if not child.is_dir():
            continue
        if _is_aux_dir(child):
            continue
        entries.append(read_entry(child, max_bytes, root))
    entries.sort(key=lambda e: (-e.mtime, e.hash))
    return entries


def get_entry(spec: str | os.PathLike, cache: str | os.PathLike | None = None, max_bytes: int | None = None) -> Entry:
    """An entry by directory path or by a unique prefix of its hash."""
    p = Path(spec).expanduser()
    if os.sep in str(spec):  # a path, not a hash prefix
        if not p.is_dir():
            raise CacheError(f"no entry directory at {p}; give an entry directory or a hash prefix")
        return read_entry(p, max_bytes)
    root = cache_dir(cache)
    prefix = str(spec).upper()
    hits = [c for c in root.iterdir() if c.is_dir() and c.name.upper().startswith(prefix)]
    if not hits:
        raise CacheError(f"no entry with hash prefix {spec!r} in {root}; `workbench asm ls` lists them")
    if len(hits) > 1:
        names = ", ".join(sorted(h.name[:12] for h in hits)[:6])
        raise CacheError(f"hash prefix {spec!r} is ambiguous in {root} ({len(hits)} entries: {names}...); give more characters")
    return read_entry(hits[0], max_bytes, root)


def select(entries: list[Entry], name: str | None = None, **filters) -> list[Entry]:
    """Entries whose kernel name matches `name` (exact or regex) and whose summary fields equal `filters`."""
    out = []
    for e in entries:
        if name and not (e.name == name or re.fullmatch(name, e.name or "")):
            continue
        row = e.summary()
        if all(v is None or str(row.get(k, e.metadata.get(k))) == str(v) for k, v in filters.items()):
            out.append(e)
    return out


# -- specializations and groups -----------------------------------------------

_FUNC_RE = re.compile(r"tt\.func public @[\w$.]+\((.*)\)\s*(?:attributes|\{)", re.S)
_ARG_RE = re.compile(r"%([\w$.]+): ([^\s{]+(?:<[^>]*>)?)(?: \{([^}]*)\})?")
_CONST_RE = re.compile(r"%([A-Za-z_][\w$]*?)(?:_\d+)? = arith\.constant (?:dense<)?([^ :>]+)>?\s*:")
_FUNC_WINDOW = 1 << 16  # characters of a kernel's signature line, at most (real ones: a few kB)
_ANON_CONST_RE = re.compile(r"c\d*(_i\d+)?|cst|true|false|c_?\w*_i\d+")
_OPTION_KEYS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_pdl",
                "launch_cooperative_grid", "warp_size", "waves_per_eu", "matrix_instr_nonkdim", "kpack",
                "triton_version", "debug", "sanitize_overflow")


def specialization(entry: Entry) -> dict:
    """Options from the metadata, argument types/attributes and named IR constants.

    Triton inlines constexprs, so their values show up as named `arith.constant`
    values of the front-end IR (for example `offs = 1024`).
    """
    spec = {"options": {k: entry.metadata.get(k) for k in _OPTION_KEYS if k in entry.metadata},
            "args": {}, "constants": {}, "constexprs": {}}
    side, _ = _read_json(entry.path / f"{entry.name}{SIDECAR}", entry.path, entry.max_bytes)
    if side and isinstance(side.get("constexprs"), dict):
        spec["constexprs"] = side["constexprs"]
    path = entry.stages.get("source") or entry.stages.get("ttir")
    if path is None:
        return spec
    try:
        text = reading.read_text(path, entry.cap, entry.path)
    except OSError:
        return spec
    start = text.find("tt.func public @")  # one bounded search: a file of many headers cannot make it quadratic
    m = _FUNC_RE.search(text, start, start + _FUNC_WINDOW) if start >= 0 else None
    if m:
        for name, typ, attrs in _ARG_RE.findall(m.group(1)):
            attrs = re.sub(r"\s*:\s*i\d+", "", attrs or "").strip()
            spec["args"][name] = f"{typ} {{{attrs}}}" if attrs else typ
    consts: dict[str, set] = {}
    for name, value in _CONST_RE.findall(text):
        if not _ANON_CONST_RE.fullmatch(name):  # keep only constants named after a variable
            consts.setdefault(name, set()).add(value)
    spec["constants"] = {k: ",".join(sorted(v)) for k, v in sorted(consts.items())}
    return spec


@dataclass
class Group:
    """Entries compiled from one kernel source, and what tells them apart."""

    name: str
    location: tuple[str, int] | None
    entries: list[Entry]

    def differences(self) -> dict[str, dict[str, list]]:
        """{section: {key: [value per entry]}} for keys whose values differ."""
        specs = [e.specialization() for e in self.entries]
        specs = [dict(s, target={"backend": e.backend, "arch": e.arch}) for s, e in zip(specs, self.entries)]
        out: dict[str, dict[str, list]] = {}
        for section in ("target", "options", "constexprs", "args", "constants"):
            keys = sorted({k for s in specs for k in s[section]})
            for k in keys:
                vals = [s[section].get(k) for s in specs]
                if len({json.dumps(v, sort_keys=True, default=str) for v in vals}) > 1:
                    out.setdefault(section, {})[k] = vals
        return out


def group_entries(entries: list[Entry]) -> list[Group]:
    """Group entries by kernel name and Python location (one source, many specializations)."""
    groups: dict[tuple, Group] = {}
    for e in entries:
        if not e.name:
            continue
        key = (e.name, e.location)
        groups.setdefault(key, Group(e.name, e.location, [])).entries.append(e)
    return sorted(groups.values(), key=lambda g: (g.name, str(g.location)))

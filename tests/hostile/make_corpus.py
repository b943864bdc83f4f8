"""Build the hostile-input corpus: damaged caches, hostile specs, report parameters.

    python tests/hostile/make_corpus.py DIR      # build into DIR and print every command

`build(root)` makes everything under `root` (big files are sparse: they cost
no disk) and returns the cases, each one command line run as a user would
(`python -m workbench.cli ...`) plus what its output must say. The corpus
test (tests/test_hostile.py) runs them as subprocesses and asserts, for each:
no traceback, no canary file (nothing executed), the cache tree unchanged,
peak resident memory under 512 MB, done within its deadline. Launcher
arguments are cases of tests/hostile/launcher_cases.py (one process).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_CACHE = ROOT / "tests" / "fixtures" / "cache"
NAME = "remote_store_kernel"
SPARSE = 2 << 30  # 2 GiB, as in the report that started this corpus
CANARY = "canary"  # created (in the working directory) only if some payload ran


@dataclass
class Case:
    name: str
    argv: list[str]  # after `python`
    expect: str | None = None  # text the output must hold (the refusal is reported, and how)
    rcs: tuple[int, ...] = (0, 2)  # allowed exit codes
    deadline_s: float = 15.0  # generous: a cache command takes about a second on a loaded 2-core machine
    env: dict = field(default_factory=dict)


def _sparse(path: Path, size: int = SPARSE, head: bytes = b"") -> Path:
    with open(path, "wb") as fh:
        fh.write(head)
        fh.truncate(size)
    return path


def _fifo(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def _symlink(path: Path, target: str | Path) -> Path:
    path.unlink(missing_ok=True)
    path.symlink_to(target)
    return path


def _fixture(arch: str) -> Path:
    """A healthy fixture entry for 'sm90' (cubin, ptx) or 'gfx942' (amdgcn)."""
    for d in sorted(FIXTURE_CACHE.iterdir()):
        meta = json.loads((d / f"{NAME}.json").read_text())
        if str(meta["target"]["arch"]) == arch.removeprefix("sm"):
            return d
    raise LookupError(arch)


def _set_location(entry: Path, file: str, line: int = 31) -> None:
    """Point the IR's location info (where `show --stage python` looks) at `file`."""
    for ext in ("source", "ttir"):
        p = entry / f"{NAME}.{ext}"
        if p.exists():
            text = p.read_text().splitlines(True)
            text[0] = f'#loc = loc("{file}":{line}:0)\n'
            p.write_text("".join(text))


def build_cache(root: Path) -> tuple[Path, list[tuple[str, str, tuple[str, ...]]]]:
    """A cache of healthy and damaged entries; (entry, what is wrong, commands) per damaged one.

    Commands name stages: 'show' (default stage), 'show:STAGE', 'mix', 'res', 'diff' (against a healthy entry).
    """
    cache = root / "cache"
    outside = root / "outside"
    cache.mkdir()
    outside.mkdir()
    sm90, gfx = _fixture("sm90"), _fixture("gfx942")
    shutil.copytree(sm90, cache / "GOODSM90")
    shutil.copytree(gfx, cache / "GOODGFX942")
    bad: list[tuple[str, str, tuple[str, ...]]] = []

    def entry(tag: str, src: Path = sm90) -> Path:
        d = cache / tag
        shutil.copytree(src, d)
        return d

    def f(d: Path, ext: str) -> Path:
        return d / (f"__grp__{NAME}.json" if ext == "grp" else f"{NAME}.{ext}")

    # Files far over the cap (2 GiB, sparse): refused by size, the listing goes on.
    for ext, cmds, expect in (("json", ("show", "res"), "read cap"), ("ptx", ("show", "mix", "opcodes", "diff"), "read cap"),
                              ("cubin", ("show:sass", "res"), "read cap"), ("llir", ("show:llir",), "read cap"),
                              ("ttgir", ("show:ttgir", "diff:ttgir"), "read cap"), ("grp", ("show",), "read cap"),
                              ("source", ("show:source", "show:python"), "read cap")):
        d = entry(f"BIG{ext.upper()}")
        _sparse(f(d, ext), head=b"\x7fELF" if ext == "cubin" else b"")
        bad.append((d.name, expect, cmds))
    d = entry("BIGAMDGCN", gfx)
    _sparse(f(d, "amdgcn"))
    bad.append((d.name, "read cap", ("show", "mix", "res")))
    # Special files where stage files belong: never opened.
    for ext, cmds in (("json", ("show", "res")), ("ptx", ("show", "mix")), ("cubin", ("show:sass", "res")),
                      ("grp", ("show",)), ("source", ("show:python",))):
        d = entry(f"FIFO{ext.upper()}")
        f(d, ext).unlink()
        _fifo(f(d, ext))
        bad.append((d.name, "FIFO", cmds))
    d = entry("SOCKETPTX")
    f(d, "ptx").unlink()
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(f(d, "ptx")))
        bad.append((d.name, "socket", ("show", "mix")))
    except OSError:  # path too long for a socket on this machine
        shutil.rmtree(d)
    # Symlinks out of the entry: to a device, to a huge file, to a readable file elsewhere.
    big_outside = _sparse(outside / "big.bin")
    for tag, ext, target, cmds in (("DEVZEROPTX", "ptx", "/dev/zero", ("show", "mix", "opcodes", "diff")),
                                   ("DEVZEROJSON", "json", "/dev/zero", ("show", "res")),
                                   ("URANDOMCUBIN", "cubin", "/dev/urandom", ("show:sass", "res")),
                                   ("OUTSIDECUBIN", "cubin", big_outside, ("show:sass", "res")),
                                   ("PASSWDPTX", "ptx", "/etc/passwd", ("show",)),
                                   ("OUTSIDEGRP", "grp", big_outside, ("show",))):
        d = entry(tag)
        _symlink(f(d, ext), target)
        bad.append((d.name, "symlink leading out of the entry", cmds))
    elsewhere = outside / "ENTRYCOPY"
    shutil.copytree(sm90, elsewhere)
    _symlink(cache / "SYMLINKENTRY", elsewhere)
    bad.append(("SYMLINKENTRY", "symlink leading out of the cache", ("show", "mix")))
    # Location info (for `--stage python`) naming hostile files.
    py_fifo = _fifo(outside / "fifo.py")
    big_py = _sparse(outside / "big.py")
    for tag, file, line, expect in (("LOCDEVZERO", "/dev/zero", 1, "not a .py file"),
                                    ("LOCPASSWD", "/etc/passwd", 1, "not a .py file"),
                                    ("LOCFIFO", str(py_fifo), 1, "FIFO"),
                                    ("LOCBIGPY", str(big_py), 1, "read cap"),
                                    ("LOCLINE", str(ROOT / "kernels" / "remote.py"), 10**6, "has"),
                                    ("LOCLINE0", str(ROOT / "kernels" / "remote.py"), 0, "has")):
        d = entry(tag)
        _set_location(d, file, line)
        bad.append((d.name, expect, ("show:python",)))
    # Damaged content under the caps.
    d = entry("GARBAGEPTX")
    # Seeded (the same garbage every run), ending in a byte other than '}' so it never
    # passes for a complete PTX file (1 random file in 256 did, and lacked its warning).
    f(d, "ptx").write_bytes(random.Random(1).randbytes(1 << 20) + b"~")
    bad.append((d.name, "truncated", ("show=", "mix", "opcodes", "diff")))
    d = entry("GARBAGECUBIN")
    f(d, "cubin").write_bytes(b"\x7fELF" + random.Random(2).randbytes(1 << 16))
    bad.append((d.name, "cuobjdump", ("show:sass", "res")))
    d = entry("DEEPJSON")
    f(d, "json").write_text("[" * 200_000 + "]" * 200_000)
    bad.append((d.name, "unreadable", ("show", "res")))
    d = entry("BIGINTJSON")
    f(d, "json").write_text('{"num_warps": ' + "9" * 100_000 + "}")
    bad.append((d.name, "unreadable", ("show",)))
    d = entry("BRACKETJSON")  # just under the JSON cap: unfolds into about 20x its size in objects
    f(d, "json").write_text("[" + ",".join(["[]"] * ((1 << 20) // 3 - 2)) + "]")
    bad.append((d.name, "not a JSON object", ("show", "res")))
    d = entry("GRPINT")
    f(d, "grp").write_text('{"child_paths": 5}')
    bad.append((d.name, "child_paths", ("show",)))
    d = entry("GRPMANY")
    f(d, "grp").write_text(json.dumps({"child_paths": {f"missing_{i}.ptx": "x" for i in range(30_000)}}))
    bad.append((d.name, "more", ("show",)))
    d = entry("METATYPES")
    f(d, "json").write_text(json.dumps({"target": [1, 2], "num_warps": "<script>alert(1)</script>",
                                        "shared": {"a": None}, "name": ["x"] * 1000}))
    bad.append((d.name, "", ("show", "mix", "res", "diff")))
    d = entry("MANYFILES")
    for i in range(10_050):
        (d / f"junk_{i}").touch()
    bad.append((d.name, "more than 10,000 names", ("show",)))
    d = entry("DIRLOOP")
    _symlink(d / "loop", ".")
    _symlink(d / "up", "..")
    bad.append((d.name, "", ("show", "mix")))
    _symlink(cache / "SELFLOOP", cache / "SELFLOOP")
    d = entry("FUTURE")
    os.utime(d, (1e12, 1e12))  # the year 33658, if the file system keeps it
    bad.append((d.name, "", ("show",)))
    # Names a shell or a web page would read as code; a cubin path handed to cuobjdump carries them.
    d = entry(f"SHELL$(touch {CANARY});`touch {CANARY}`")
    bad.append((d.name, "", ("show:sass", "res")))
    d = cache / "HTMLNAME"
    d.mkdir()
    for p in sm90.iterdir():
        shutil.copy(p, d / p.name.replace(NAME, '<img src=x onerror="alert(1)">\n名前'))
    bad.append((d.name, "", ("show", "mix", "res")))
    d = entry("tmp.pid_1_2")
    bad.append((d.name, "half-written", ("show",)))
    return cache, bad


def cache_cases(root: Path) -> list[Case]:
    cache, bad = build_cache(root)
    py = ["-m", "workbench.cli", "asm"]
    c = ["--cache", str(cache)]
    cases = [Case("ls", py + ["ls"] + c, "entries with problems", rcs=(0,)),
             Case("ls --json", py + ["ls", "--json"] + c, "read cap", rcs=(0,)),
             Case("ls --groups", py + ["ls", "--groups"] + c, None, rcs=(0,))]
    for tag, expect, cmds in bad:
        for cmd in cmds:
            cmd, sep, alt = cmd.partition("=")
            verb, _, stage = cmd.partition(":")
            argv = py + ["mix", tag, "--opcodes"] if verb == "opcodes" else py + [verb, tag]
            if verb == "diff":
                argv.append("GOODSM90")
            if stage:
                argv += ["--stage", stage]
            cases.append(Case(f"{cmd} {tag}", argv + c, (alt if sep else expect) or None))
    return cases


def tool_cases(root: Path) -> list[Case]:
    """Disassemblers that hang, flood or fail: one shared deadline per entry."""
    bin_dir = root / "bin"
    bin_dir.mkdir()
    scripts = {
        "hang": "#!/bin/sh\nsleep 300\n",
        "hang_child": "#!/bin/sh\nsleep 300 &\nwait\n",  # the grandchild holds the output too
        "flood": "#!/bin/sh\nexec yes 'STG.E.128 [R2.64], R4 ;'\n",
        "fail": "#!/bin/sh\necho 'cuobjdump fatal: not a cubin' >&2\nexit 1\n",
    }
    for name, text in scripts.items():
        p = bin_dir / name
        p.write_text(text)
        p.chmod(0o755)
    cache = root / "cache"
    py = ["-m", "workbench.cli", "asm"]
    c = ["--cache", str(cache)]
    out = []
    for cuobj, nvdis, expect in (("hang", "hang", "did not finish within the 2 s"),
                                 ("hang_child", "hang", "did not finish within the 2 s"),
                                 ("fail", "hang", "did not finish within the 2 s"),  # both share the 2 s
                                 ("flood", "flood", "wrote more than")):
        env = {"TRITON_CUOBJDUMP_PATH": str(bin_dir / cuobj), "TRITON_NVDISASM_PATH": str(bin_dir / nvdis),
               "WORKBENCH_ASM_TOOL_TIMEOUT_S": "2"}
        for verb in (["show", "GOODSM90", "--stage", "sass"], ["mix", "GOODSM90", "--stage", "sass"],
                     ["res", "GOODSM90"]):
            out.append(Case(f"{cuobj}/{nvdis} {' '.join(verb)}", py + verb + c, expect, deadline_s=12, env=env))
    for var, value in (("WORKBENCH_ASM_TOOL_TIMEOUT_S", "-1"), ("WORKBENCH_ASM_TOOL_TIMEOUT_S", "nan"),
                       ("WORKBENCH_ASM_MAX_FILE_MB", "lots"), ("WORKBENCH_ASM_MAX_FILE_MB", "0")):
        verb = ["res", "GOODSM90"] if "TOOL" in var else ["ls"]
        out.append(Case(f"{var}={value}", py + verb + c, var, env={var: value}))
    # Types are text too: Triton evals the layout of a Gluon descriptor type, so only literals get through.
    layout = f"NVMMASharedLayout(rank=__import__('os').system('touch {CANARY}'))"
    out.append(Case("compile with a code layout", py + [
        "compile", "kernels.gemm.gluon:_gemm_ws_kernel", "--target", "sm90", "--cache", str(root / "compile_cache"),
        "--arg", f"a_desc=tensordesc<bf16[128, 64],{layout}>"], "literal arguments", rcs=(2,), deadline_s=30))
    # At the cap: a stage file just under it still costs bounded memory (counted without holding every line).
    d = cache / "ATCAP"
    shutil.copytree(_fixture("sm90"), d)
    line = b"\tld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];\n"
    cap = 8 << 20
    (d / f"{NAME}.ptx").write_bytes(line * (cap // len(line)))
    env = {"WORKBENCH_ASM_MAX_FILE_MB": "8"}
    out.append(Case("mix at the cap", py + ["mix", "ATCAP"] + c, "ld.global.v4.b32", env=env))
    d = cache / "SHORTLINES"  # the worst case for a list of lines: two bytes each
    shutil.copytree(_fixture("sm90"), d)
    (d / f"{NAME}.ptx").write_bytes(b"".join(b"%c\n" % (97 + i % 26) for i in range(cap // 2)))
    out.append(Case("mix of short lines at the cap", py + ["mix", "SHORTLINES"] + c, "truncated", env=env))
    out.append(Case("diff over the line limit", py + ["diff", "SHORTLINES", "GOODSM90"] + c,
                    "side-by-side diffs stop", env=env))
    return out


SPEC_BASE = """name: hostile
kernel: kernels.gemm.sweep
dtypes: [bfloat16]
shapes: [{M: 256, N: 256, K: 256}]
grid: {block_m: [64, 128]}
"""
_WALK = "().__class__.__base__.__subclasses__()"
_SYSTEM = f"[c for c in {_WALK} if c.__name__ == 'catch_warnings'][0]()._module.__builtins__['__import__']" \
          f"('os').system('touch {CANARY}')"
CONSTRAINTS = {  # the escape attempts, each refused when the spec is loaded
    "subclasses walk": (_SYSTEM, "not allowed"),
    "attribute walk": (f"len({_WALK}) > 0", "not allowed"),
    "import": (f"__import__('os').system('touch {CANARY}') == 0", "not allowed"),
    "import call": ("__import__('os')", "calling __import__"),
    "lambda": (f"(lambda: __import__('os').system('touch {CANARY}'))() == 0", "lambda"),
    "open": (f"open('{CANARY}', 'w') is None", "calling open"),
    "eval": (f"eval(\"__import__('os').system('touch {CANARY}')\") == 0", "calling eval"),
    "exec": (f"exec(\"open('{CANARY}', 'w')\") is None", "calling exec"),
    "getattr": ("getattr(1, '__class__') is None", "calling getattr"),
    "globals": ("globals() is None", "calling globals"),
    "breakpoint": ("breakpoint() is None", "calling breakpoint"),
    "comprehension": ("[x for x in (1, 2)] == 1", "comprehensions"),
    "generator": ("max(x for x in (1, 2)) > 0", "generator expressions"),
    "attribute on a name": ("M.real > 0", "attribute access"),
    "subscript": ("M[0] > 0", "subscripts"),
    "f-string": ("f'{M}' == '256'", "f-strings"),
    "walrus": ("(M := 1) > 0", "assignment"),
    "keyword": ("max(M, key=abs) > 0", "keyword arguments"),
    "dunder name": ("__builtins__ is None", "names starting with '_'"),
    "too long": ("M + " * 5000 + "1 > 0", "at most 2000"),
    "NUL": ("M\x00 > 0", "invalid expression"),
    "nesting": ("(" * 300 + "M" + ")" * 300 + " > 0", "invalid expression"),
    "power tower": ("10**10**10 > M", "exceeds 256 bits"),  # needs the kernel's names: evaluated after import
    "shift": ("1 << 10**9 > M", "exceeds 256 bits"),
    "text times": ("dtype * 10**9 == ''", "needs numbers"),
}


def spec_cases(root: Path) -> list[Case]:
    d = root / "specs"
    d.mkdir()
    sweep = ["-m", "workbench.cli", "sweep"]
    cases: list[Case] = []

    def spec(name: str, text: str | bytes, expect: str, extra: tuple = (), deadline: float = 30.0) -> None:
        p = d / f"{name.replace(' ', '_')}.yaml"
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        cases.append(Case(f"spec {name}", sweep + [str(p), "--dry-run", *extra], expect, rcs=(2,),
                          deadline_s=deadline))

    tiny = SPEC_BASE.replace("kernels.gemm.sweep", "hostile_tiny_kernel")  # no torch: starts fast
    for name, (expr, expect) in CONSTRAINTS.items():
        spec(f"constraint {name}", tiny + "constraints:\n  - " + json.dumps(expr) + "\n", expect)
    spec("quick constraint", tiny + "quick:\n  constraints: [" + json.dumps(_SYSTEM) + "]\n", "not allowed",
         ("--quick",))
    spec("constraint not text", SPEC_BASE + "constraints: [{a: 1}]\n", "expected an expression string")
    for tag, text in (("apply", f'!!python/object/apply:os.system ["touch {CANARY}"]'),
                      ("name", "!!python/name:os.system"),
                      ("new", f'!!python/object/new:subprocess.Popen [["touch", "{CANARY}"]]')):
        spec(f"yaml tag {tag}", SPEC_BASE + f"description: {text}\n", "not valid YAML")
    laughs = "".join(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]\n" for i in range(1, 9))
    spec("billion laughs", SPEC_BASE + "l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + laughs,
         "aliases")
    spec("merge chain", SPEC_BASE + "".join(f"m{i}: &m{i} {{<<: *m{i - 1}, k{i}: 1}}\n" for i in range(1, 5000))
         .replace("<<: *m0, ", ""), "aliases")  # merge keys are copied: quadratic memory if built
    spec("recursive alias", "name: &n [*n]\n" + SPEC_BASE.split("\n", 1)[1], "aliases")
    spec("deep nesting", "description: " + "[" * 20_000 + "]" * 20_000 + "\n", "nested too deeply")
    spec("not utf-8", b"name: \xff\xfe\x00bad\n", "not UTF-8")
    big = _sparse(d / "big.yaml")
    cases.append(Case("spec 2 GiB", sweep + [str(big), "--dry-run"], "at most", rcs=(2,)))
    fifo = _fifo(d / "fifo.yaml")
    cases.append(Case("spec FIFO", sweep + [str(fifo), "--dry-run"], "not a regular file", rcs=(2,)))
    dev = _symlink(d / "zero.yaml", "/dev/zero")
    cases.append(Case("spec /dev/zero", sweep + [str(dev), "--dry-run"], "not a regular file", rcs=(2,)))
    for mod in ("antigravity", "this", "os", "http.server", f"kernels.gemm.sweep; touch {CANARY}"):
        spec(f"kernel {mod.split(';')[0]}", SPEC_BASE.replace("kernels.gemm.sweep", json.dumps(mod)), "kernel")
    spec("name traversal", SPEC_BASE.replace("name: hostile", "name: ../../etc"), "name")
    spec("grid explosion", tiny.replace("{block_m: [64, 128]}", "{" + ", ".join(
        f"{k}: [{', '.join(map(str, range(1, 60)))}]" for k in ("group_m", "block_m", "num_stages", "block_k")) + "}"),
        "points")
    spec("shape explosion", SPEC_BASE.replace("[{M: 256, N: 256, K: 256}]", "[{M: [" + ", ".join(
        map(str, range(1, 1001))) + "], N: [" + ", ".join(map(str, range(1, 1001))) + "], K: 64}]"), "shapes")
    spec("huge world", tiny + "world_size: " + "9" * 400 + "\n", "world_size")
    spec("huge repeats", tiny + "repeats: " + "9" * 40 + "\n", "points")
    spec("nan timeout", SPEC_BASE + "launch_timeout_s: .nan\n", "launch_timeout_s")
    spec("huge tile", SPEC_BASE.replace("[64, 128]", "[1099511627776]") + "constraints: [smem_bytes <= SMEM_LIMIT]\n",
         "leave no point")  # the kernel's derived sizes of a 2**40 tile are compared, not built
    cases.append(Case("spec gemm_tiling (healthy)", sweep + [str(ROOT / "experiments" / "gemm_tiling.yaml"),
                                                             "--dry-run"], "spec OK", rcs=(0,), deadline_s=30))
    return cases


NOTEBOOK = {"cells": [
    {"cell_type": "code", "metadata": {"tags": ["parameters"]}, "source": "x = 1", "outputs": [],
     "execution_count": None},
    {"cell_type": "code", "metadata": {}, "source": "print(repr(x))", "outputs": [], "execution_count": None}],
    "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    "nbformat": 4, "nbformat_minor": 5}


def report_cases(root: Path) -> list[Case]:
    d = root / "report"
    d.mkdir()
    nb = d / "tiny.ipynb"
    nb.write_text(json.dumps(NOTEBOOK))
    out = d / "out"
    rep = ["-m", "workbench.cli", "report"]
    cases: list[Case] = []

    def param(name: str, pname: str, value: str, expect: str, rcs=(2,), deadline: float = 30.0) -> None:
        cases.append(Case(f"report {name}", rep + [str(nb), "-p", pname, value, "--out", str(out), "--no-progress"],
                          expect, rcs=rcs, deadline_s=deadline))

    param("deep nesting", "y", "[" * 50_000, "nested too deeply")
    param("deep mapping", "y", "{a: " * 20_000, "nested too deeply")
    param("billion laughs", "y", "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{k}: &{k} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, k in zip("abcdefgh", "bcdefghi")), "aliases")
    param("recursive alias", "y", "&a [*a]", "aliases")
    param("python tag", "y", f'!!python/object/apply:os.system ["touch {CANARY}"]', "unknown parameter")
    param("name with code", f"x;__import__('os').system('touch {CANARY}')", "1", "Python identifier")
    param("dunder name", "__import__", "1", "unknown parameter")
    # A known parameter: the notebook runs, and the value stays text (papermill writes it as a literal).
    param("code as a value", "x", f"__import__('os').system('touch {CANARY}')", "ok", rcs=(0,), deadline=90)
    for tag, path in (("FIFO", _fifo(d / "fifo.ipynb")), ("2 GiB", _sparse(d / "big.ipynb")),
                      ("/dev/zero", _symlink(d / "zero.ipynb", "/dev/zero"))):
        cases.append(Case(f"report notebook {tag}", rep + [str(path), "--out", str(out)],
                          "not a regular file" if tag != "2 GiB" else "are not read", rcs=(2,), deadline_s=30))
    return cases


def table_cases(root: Path) -> list[Case]:
    """Tuning tables (kernels.common.tables) as a user's cache directory may hold them: read by
    ``workbench tune --show`` and by a GEMM call that consults them."""
    cases: list[Case] = []
    show = ["-m", "workbench.cli", "tune", "--show", "gemm"]
    payload = f"__import__('os').system('touch {CANARY}')"
    head = {"format": "kernel-workbench tuning table", "version": 1, "device": "Triton interpreter",
            "capability": "cpu", "triton": "3.6.0", "family": "gemm"}
    bodies = {
        "garbage": (b"\x00\xff{{{" * 1000, "not valid JSON"),
        "deep nesting": (b"[" * 200_000 + b"]" * 200_000, "not valid JSON"),
        "payload entry": (json.dumps({**head, "entries": {payload: {"candidate": payload, "variant": payload,
                                                                     "config": {"block_m": payload}}}}).encode(),
                          "1 entries"),
    }
    for name, (body, expect) in bodies.items():
        d = root / "tables" / name.replace(" ", "_")
        (d / "triton-interpreter").mkdir(parents=True)
        (d / "triton-interpreter" / "gemm.json").write_bytes(body)
        cases.append(Case(f"table {name}", show, expect, rcs=(0,), deadline_s=30,
                          env={"WORKBENCH_TUNING_DIR": str(d), "TRITON_INTERPRET": "1"}))
    for name, make, expect in (("2 GiB", lambda p: _sparse(p), "larger than"), ("FIFO", _fifo, "no tables"),
                               ("/dev/zero", lambda p: _symlink(p, "/dev/zero"), "no tables")):
        d = root / "tables" / name.replace(" ", "_").replace("/", "")
        (d / "triton-interpreter").mkdir(parents=True)
        make(d / "triton-interpreter" / "gemm.json")
        cases.append(Case(f"table {name}", show, expect, rcs=(0,), deadline_s=30,
                          env={"WORKBENCH_TUNING_DIR": str(d), "TRITON_INTERPRET": "1"}))
    # A GEMM call whose user table names a payload as its config: refused (said), the cold rule runs it.
    d = root / "tables" / "payload_call" / "triton-interpreter"
    d.mkdir(parents=True)
    key = "dtype=fp16,M=8,N=8,K=16,b=row,tma=111"   # kernels.gemm.select.problem of the call below
    (d / "gemm.json").write_text(json.dumps({**head, "entries": {key: {
        "candidate": payload, "variant": "persistent", "config": {"block_m": payload, "num_warps": 1e308}}}}))
    code = ("import torch; from kernels.gemm import launch as L; a = torch.randn(8, 16).half(); "
            "b = torch.randn(16, 8).half(); c = L.matmul(a, b); ok = torch.allclose(c.float(), a.float() @ b.float(), "
            "atol=1e-2, rtol=1e-2); print('cold rule served' if ok and L.plan_for(a, b).choice.source == 'cold' "
            "else 'WRONG')")
    cases.append(Case("table payload config in a call", ["-c", code], "cannot run here", rcs=(0,), deadline_s=60,
                      env={"WORKBENCH_TUNING_DIR": str(d.parent), "TRITON_INTERPRET": "1"}))
    return cases


def build(root: Path) -> list[Case]:
    """Every case (caches, tools, specs, report parameters) built under `root`."""
    root = Path(root)
    cases = cache_cases(root) + tool_cases(root) + spec_cases(root) + report_cases(root) + table_cases(root)
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), "case names must be unique"
    return cases


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_corpus.py DIR (an empty or new directory)")
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    for case in build(target):
        env = " ".join(f"{k}={v}" for k, v in case.env.items())
        print(f"{case.name}\n    {env + ' ' if env else ''}python {' '.join(case.argv)!r}")

"""The closed expression evaluator of spec constraints, and bounded YAML specs."""
import time
from pathlib import Path

import pytest

from workbench import safe_expr, safe_yaml
from workbench.safe_expr import ExprError, check, evaluate, names_of
from workbench.spec import SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted((ROOT / "experiments").glob("*.yaml"))


def _constraints(spec: dict) -> list[str]:
    out = list(spec.get("constraints") or [])
    out += list((spec.get("quick") or {}).get("constraints") or [])
    return [out] if isinstance(out, str) else out


def test_every_constraint_in_experiments_is_accepted():
    seen = 0
    for path in SPECS:
        for c in _constraints(safe_yaml.load_file(path)):
            check(c)
            names = {n: 7 + i for i, n in enumerate(sorted(names_of(c)))}
            assert isinstance(evaluate(c, names), bool), (path, c)
            seen += 1
    assert seen >= 2  # gemm_tiling.yaml has two today


@pytest.mark.parametrize("text, value", [
    ("smem_bytes <= SMEM_LIMIT", True),
    ("cdiv(M, 128) * cdiv(N, 64) >= 132 or M > 4096", False),
    ("min(block_m, block_n) in (64, 128) and dtype == 'bfloat16'", True),
    ("log2(block_m) % 1 == 0 and not (block_m > 256)", True),
    ("2 ** 8 if M < 10 else -1", -1),
    ("0 < block_m <= 256 < M * 1000", True),
    ("ceil(M / 3) + floor(1.5) + abs(-2) + max(1, 2, 3) + int(2.9) + sqrt(16)", 1000 // 3 + 1 + 1 + 2 + 3 + 2 + 4),
])
def test_plain_expressions_evaluate_like_python(text, value):
    names = {"smem_bytes": 1000, "SMEM_LIMIT": 232448, "M": 1000, "N": 512, "block_m": 128, "block_n": 64,
             "dtype": "bfloat16"}
    assert evaluate(text, names) == value


@pytest.mark.parametrize("text, construct", [
    ("().__class__.__base__.__subclasses__()", "attribute access (.__subclasses__)"),
    ("[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'Popen'][0]('touch x', shell=True)",
     "subscripts"),
    ("(1).__class__", "attribute access (.__class__)"),
    ("M.bit_length() > 3", "attribute access (.bit_length)"),
    ("__import__('os').system('touch x')", "attribute access (.system)"),
    ("__import__('os')", "calling __import__"),
    ("eval('1')", "calling eval"),
    ("open('/etc/passwd')", "calling open"),
    ("(lambda: 1)()", "lambda"),
    ("lambda: 1", "lambda"),
    ("[x for x in (1, 2)]", "comprehensions"),
    ("sum(x for x in (1, 2))", "calling sum"),
    ("min(*names)", "starred"),
    ("max(1, key=abs)", "keyword arguments"),
    ("(x := 3) > 2", "assignment"),
    ("f'{M}' == '1'", "f-strings"),
    ("params['M'] > 1", "subscripts"),
    ("{1: 2}", "dict literals"),
    ("_hidden > 1", "names starting with '_'"),
    ("M @ N", "operator MatMult"),
])
def test_escapes_are_refused_before_anything_runs(text, construct):
    with pytest.raises(ExprError, match="not allowed") as info:
        check(text)
    assert construct in str(info.value)
    assert "min, max" in str(info.value)  # the message says what is allowed


@pytest.mark.parametrize("text", ["10**10**10", "2**10**6", "1 << 10**9", "(10**9) ** (10**9)", "M ** 1000",
                                  "9 ** 9 ** 9 ** 9"])
def test_powers_and_shifts_are_bounded(text):
    t0 = time.perf_counter()
    with pytest.raises(ExprError, match="exceeds"):
        evaluate(text, {"M": 1 << 20})
    assert time.perf_counter() - t0 < 0.5


@pytest.mark.parametrize("text, names, match", [
    ("'a' * 10**8", {}, "needs numbers"),
    ("dtype + dtype", {"dtype": "bf16"}, "needs numbers"),
    ("x > 1", {"x": object()}, "not a number or text"),
    ("f > 1", {"f": print}, "not a number or text"),
    ("wrok > 1", {"work": 1}, "unknown name 'wrok'"),
    ("1 / 0", {}, "ZeroDivisionError"),
    ("2.0 ** 10 ** 4", {}, "OverflowError"),
    ("'a' < 1", {}, "TypeError"),
    ("9" * 3000, {}, "at most 2000"),
    ("(" * 500 + "1" + ")" * 500, {}, "invalid expression"),
    ("1 +", {}, "invalid expression"),
    ("a\x00", {}, "invalid expression"),
    ("min()", {}, "takes 1 to 16"),
    ("cdiv(1)", {}, "takes 2 argument"),
])
def test_bad_values_and_text_give_an_expr_error(text, names, match):
    with pytest.raises(ExprError, match=match):
        evaluate(text, names)


def _spec(constraint):
    return {"name": "t", "kernel": "kernels.gemm.sweep", "shapes": [{"M": 64, "N": 64, "K": 64}], "grid": {},
            "constraints": [constraint]}


def test_a_spec_with_an_escape_is_refused_when_loaded_naming_the_field(tmp_path):
    canary = tmp_path / "canary"
    evil = f"[c for c in ().__class__.__base__.__subclasses__() if 'wrap_close' in c.__name__][0]" \
           f".__init__.__globals__['system']('touch {canary}')"
    with pytest.raises(SpecError, match=r"constraints\[0\]: .*(subscripts|comprehensions|attribute access) not allowed"):
        parse_spec(_spec(evil), path=tmp_path / "evil.yaml", import_kernel=False)
    assert not canary.exists()


def test_spec_files_are_read_within_bounds(tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as fh:  # sparse: costs no disk
        fh.truncate(2 << 30)
    with pytest.raises(safe_yaml.YamlError, match="at most"):
        safe_yaml.load_file(big)
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{k}: &{k} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, k in zip("abcdefgh", "bcdefghi"))
    with pytest.raises(safe_yaml.YamlError, match="aliases"):
        safe_yaml.load_text(bomb)
    with pytest.raises(safe_yaml.YamlError, match="aliases"):
        safe_yaml.load_text("a: &a [*a]")  # recursive
    merges = "a0: &a0 {k0: 1}\n" + "".join(f"a{i}: &a{i} {{<<: *a{i - 1}, k{i}: 1}}\n" for i in range(1, 2000))
    with pytest.raises(safe_yaml.YamlError, match="aliases"):  # merge keys copy: quadratic if built
        safe_yaml.load_text(merges)
    assert safe_yaml.load_text("a: &a {x: 1}\nb: {<<: *a, y: 2}")["b"] == {"x": 1, "y": 2}
    assert safe_yaml.load_text("grid: {block_m: [64, 128]}") == {"grid": {"block_m": [64, 128]}}


def test_a_grid_too_large_is_refused_before_expanding(tmp_path):
    spec = _spec("M > 0")
    spec["grid"] = {f"p{i}": list(range(100)) for i in range(6)}
    with pytest.raises(SpecError, match=r"grid: 1,000,000,000,000 points"):
        parse_spec(spec, path=tmp_path / "s.yaml", import_kernel=False)
    spec = _spec("M > 0")
    spec["shapes"] = [{"M": list(range(1000)), "N": list(range(1000)), "K": list(range(1000))}]
    with pytest.raises(SpecError, match=r"shapes\[0\]: expands to more than"):
        parse_spec(spec, path=tmp_path / "s.yaml", import_kernel=False)


def test_limits_are_what_the_docs_say():
    assert safe_expr.MAX_INT_BITS >= 64 and safe_expr.MAX_CHARS >= 200

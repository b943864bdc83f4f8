"""A closed evaluator for the small expressions an experiment spec may hold.

Sweep constraints such as ``smem_bytes <= SMEM_LIMIT`` come from YAML files
that people share (in pull requests, in issue threads), so reading one must
not be able to run code. ``eval`` with empty builtins is no sandbox: an
attribute walk (``().__class__.__base__.__subclasses__()``) reaches every
class in the process. This module parses the text with ``ast`` and walks the
tree itself, allowing only (an allowlist, checked before anything runs):

- numbers, text and ``True``/``False``/``None`` written as literals, and
  tuples/lists of them (for ``x in (64, 128)``);
- the names of the point (shape, parameters, ``dtype``, the kernel's derived
  names), whose values must be numbers, bools, text or None;
- arithmetic ``+ - * / // % **``, bit operations ``<< >> & | ^ ~`` and unary
  ``+ -`` on numbers only; comparisons (chained too), ``in``, ``and``/``or``/
  ``not``, and ``a if cond else b``;
- calls of the fixed functions in ``FUNCTIONS`` by their bare name, with
  positional arguments.

Everything else (attribute access, subscripts, calls of anything else,
keyword or starred arguments, comprehensions, lambdas, walrus, f-strings...)
is refused by ``check`` with an ``ExprError`` naming the construct; callers
run ``check`` when they load a spec so the error names the spec's field.
Sizes are bounded so that no expression can exhaust memory or time: the text
is at most ``MAX_CHARS`` long, integers stay within ``MAX_INT_BITS`` bits
(``10**10**10`` is refused before it is computed), and text is never
multiplied or added.

Why not a library: simpleeval (1.0) and asteval (1.0) were considered.
Both evaluate attribute access and decide safety by denylists of attribute
names, checked only while evaluating (simpleeval refuses names starting with
``_`` and some frame attributes; asteval keeps an UNSAFE_ATTR list), and both
have had sandbox escapes through attributes nobody had listed (simpleeval
issue #138: a generator's ``gi_frame``; asteval issue #86: ``__reduce__``).
asteval is a whole interpreter (loops, function definitions, imports of
numpy), far more than a constraint needs. Neither offers a check of the
parsed tree before evaluation, which we need to refuse a spec when it is
loaded, naming the field. An allowlist of a dozen node types is short enough
to read in full, which is the property that matters here.
"""
from __future__ import annotations

import ast
import functools
import math
import operator
from typing import Any, Mapping

__all__ = ["ExprError", "FUNCTIONS", "MAX_CHARS", "MAX_INT_BITS", "check", "evaluate", "names_of"]

MAX_CHARS = 2000  # an expression longer than this is refused (constraints are one-liners)
MAX_INT_BITS = 256  # integers beyond 2**256 have no business in a constraint; bounds ** and <<
MAX_ARGS = 16  # arguments of one call (min/max of many names)


def _cdiv(a, b):
    return -(-a // b)


# name -> (function, minimum number of arguments, maximum)
FUNCTIONS: dict[str, tuple[Any, int, int]] = {
    "min": (min, 1, MAX_ARGS), "max": (max, 1, MAX_ARGS), "abs": (abs, 1, 1),
    "ceil": (math.ceil, 1, 1), "floor": (math.floor, 1, 1), "log2": (math.log2, 1, 1),
    "sqrt": (math.sqrt, 1, 1), "cdiv": (_cdiv, 2, 2), "int": (int, 1, 1), "bool": (bool, 1, 1),
}

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
           ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitAnd: operator.and_,
           ast.BitOr: operator.or_, ast.BitXor: operator.xor}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Not: operator.not_, ast.Invert: operator.invert}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
            ast.NotIn: lambda a, b: a not in b}
_SCALARS = (int, float, bool, str, type(None))
# What a refused node is called in the error message.
_NAMES = {ast.Attribute: "attribute access", ast.Subscript: "subscripts", ast.Lambda: "lambda",
          ast.ListComp: "comprehensions", ast.SetComp: "comprehensions", ast.DictComp: "comprehensions",
          ast.GeneratorExp: "generator expressions", ast.NamedExpr: "assignment (:=)",
          ast.JoinedStr: "f-strings", ast.Starred: "starred arguments", ast.Dict: "dict literals",
          ast.Set: "set literals", ast.Await: "await", ast.Yield: "yield", ast.YieldFrom: "yield",
          ast.Slice: "slices"}
ALLOWED = ("numbers, text, the point's names, arithmetic, comparisons, and/or/not, "
           "'a if c else b' and the functions " + ", ".join(FUNCTIONS))


class ExprError(ValueError):
    """An expression that is refused, or that failed; the message says why."""


def _refuse(node: ast.AST, what: str | None = None) -> ExprError:
    what = what or _NAMES.get(type(node), f"{type(node).__name__} nodes")
    snippet = ""
    if isinstance(node, ast.Attribute):
        snippet = f" (.{node.attr})"
    return ExprError(f"{what}{snippet} not allowed: use only {ALLOWED}")


@functools.lru_cache(maxsize=256)
def check(text: str) -> ast.Expression:
    """The parsed expression, or ExprError naming the first construct that is not allowed."""
    if not isinstance(text, str):
        raise ExprError(f"expected an expression as text, got {type(text).__name__}")
    if len(text) > MAX_CHARS:
        raise ExprError(f"expression of {len(text)} characters; at most {MAX_CHARS} are allowed")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExprError(f"invalid expression: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:  # NUL bytes, absurd nesting
        raise ExprError(f"invalid expression: {type(exc).__name__}") from None
    for node in ast.walk(tree):
        _check_node(node)
    return tree


def _check_node(node: ast.AST) -> None:
    if isinstance(node, (ast.Expression, ast.Load, ast.operator, ast.cmpop, ast.boolop)):
        if isinstance(node, ast.operator) and type(node) not in _BINOPS:
            raise _refuse(node, f"operator {type(node).__name__}")
        return
    if isinstance(node, ast.unaryop):
        return
    if isinstance(node, ast.Constant):
        if not isinstance(node.value, _SCALARS):
            raise _refuse(node, f"{type(node.value).__name__} literals")
        if isinstance(node.value, int) and node.value.bit_length() > MAX_INT_BITS:
            raise ExprError(f"the number {str(node.value)[:20]}... exceeds {MAX_INT_BITS} bits")
        return
    if isinstance(node, ast.Name):
        if node.id.startswith("_"):
            raise _refuse(node, f"the name {node.id!r}: names starting with '_'")
        return
    if isinstance(node, ast.Call):
        if type(node.func) in _NAMES:  # e.g. x.__subclasses__(): name the attribute walk, not the call
            raise _refuse(node.func)
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            called = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)[:40]
            raise _refuse(node, f"calling {called}")
        if node.keywords:
            raise _refuse(node, "keyword arguments")
        _, lo, hi = FUNCTIONS[node.func.id]
        if not lo <= len(node.args) <= hi:
            raise ExprError(f"{node.func.id} takes {lo}{'' if lo == hi else f' to {hi}'} argument(s), "
                            f"got {len(node.args)}")
        return
    if isinstance(node, (ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Tuple, ast.List)):
        return
    raise _refuse(node)


def names_of(text: str) -> set[str]:
    """The point names an expression uses (function names excluded)."""
    tree = check(text)
    funcs = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in funcs}


def evaluate(text: str, names: Mapping[str, Any]) -> Any:
    """The value of ``text`` with ``names`` bound; ExprError when refused or failing."""
    tree = check(text)
    try:
        return _eval(tree.body, names)
    except ExprError:
        raise
    except (ArithmeticError, ValueError, TypeError) as exc:
        raise ExprError(f"{type(exc).__name__}: {exc}") from None
    except RecursionError:
        raise ExprError("expression nested too deeply") from None


def _number(x, what: str):
    if not isinstance(x, (int, float)):  # bool is an int: True + 1 is fine
        raise ExprError(f"{what} needs numbers, got {type(x).__name__} {str(x)[:40]!r}")
    return x


def _bounded(x):
    if isinstance(x, int) and x.bit_length() > MAX_INT_BITS:
        raise ExprError(f"an intermediate integer exceeds {MAX_INT_BITS} bits")
    return x


def _binop(op: ast.operator, a, b):
    sym = type(op).__name__
    _number(a, sym)
    _number(b, sym)
    if isinstance(op, ast.Pow) and isinstance(a, int) and isinstance(b, int) and abs(a) > 1:
        # Decide from the sizes before computing: 10**10**10 never gets built.
        if b * (abs(a).bit_length() - 1) > MAX_INT_BITS:
            raise ExprError(f"{a} ** {b} exceeds {MAX_INT_BITS} bits")
    if isinstance(op, ast.LShift) and isinstance(b, int) and b > MAX_INT_BITS:
        raise ExprError(f"shift by {b} exceeds {MAX_INT_BITS} bits")
    return _bounded(_BINOPS[type(op)](a, b))


def _eval(node: ast.AST, names: Mapping[str, Any]):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise ExprError(f"unknown name {node.id!r}")
        value = names[node.id]
        if not isinstance(value, _SCALARS):
            raise ExprError(f"the name {node.id!r} is a {type(value).__name__}, not a number or text")
        return value
    if isinstance(node, (ast.Tuple, ast.List)):
        return tuple(_eval(e, names) for e in node.elts)
    if isinstance(node, ast.BinOp):
        return _binop(node.op, _eval(node.left, names), _eval(node.right, names))
    if isinstance(node, ast.UnaryOp):
        value = _eval(node.operand, names)
        if not isinstance(node.op, ast.Not):
            _number(value, type(node.op).__name__)
        return _UNARY[type(node.op)](value)
    if isinstance(node, ast.BoolOp):  # short-circuit, like Python
        value = None
        for v in node.values:
            value = _eval(v, names)
            if bool(value) is isinstance(node.op, ast.Or):
                return value
        return value
    if isinstance(node, ast.Compare):
        left = _eval(node.left, names)
        for op, comp in zip(node.ops, node.comparators):
            right = _eval(comp, names)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.IfExp):
        return _eval(node.body if _eval(node.test, names) else node.orelse, names)
    if isinstance(node, ast.Call):
        func = FUNCTIONS[node.func.id][0]
        args = [_eval(a, names) for a in node.args]
        if func is not bool:
            for a in args:
                _number(a, node.func.id)
        return _bounded(func(*args))
    raise _refuse(node)  # check() let nothing else through; kept as a second lock

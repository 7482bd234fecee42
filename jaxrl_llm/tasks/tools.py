"""Tools for multi-turn tasks, run in the sandbox (`sandbox.ToolRunner`): module-level functions
from text to text.

`calculator`: arithmetic on integers and decimals (+ - * / // % **, parentheses, unary minus),
parsed with `ast`, never `eval`; powers and results are bounded so one call cannot run away.
`python`: runs a snippet and returns what it printed (stdout and stderr, bounded as it is
written) and, if it raised, the error's last line.
"""

from __future__ import annotations

import ast
import contextlib
import io
import operator
import traceback

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_DIGITS = 60  # a result's size, in decimal digits


def calculator(expression: str) -> str:
    """The value of `expression`: an integer when exact, else a float (repr). Raises ValueError
    on anything that is not arithmetic, or on a result beyond MAX_DIGITS digits."""
    value = _eval(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def _eval(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(b) * max(len(str(abs(int(a)))), 1) > MAX_DIGITS:
            raise ValueError(f"power too large: {a} ** {b}")
        out = _BINARY[type(node.op)](a, b)
        if isinstance(out, int) and len(str(abs(out))) > MAX_DIGITS:
            raise ValueError(f"result beyond {MAX_DIGITS} digits")
        return out
    raise ValueError(f"not arithmetic: {ast.dump(node)[:80]}")


class _Bounded(io.TextIOBase):
    """A text sink that keeps its first `limit` characters and counts the rest."""

    def __init__(self, limit: int):
        self.limit, self.parts, self.size, self.dropped = limit, [], 0, 0

    def write(self, s: str) -> int:
        room = self.limit - self.size
        if room > 0:
            self.parts.append(s[:room])
            self.size += min(len(s), room)
        self.dropped += max(len(s) - max(room, 0), 0)
        return len(s)

    def text(self) -> str:
        out = "".join(self.parts)
        return out + (f"\n[... {self.dropped} more characters cut]" if self.dropped else "")


def python(code: str, limit: int = 1 << 16) -> str:
    """Run `code` (in this sandboxed worker) and return its printed output and, if it raised,
    the exception's last line. Output beyond `limit` characters is dropped as it is written."""
    sink = _Bounded(limit)
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        try:
            exec(compile(code, "<tool>", "exec"), {"__name__": "__tool__"})
        except BaseException:  # the snippet's own error (SystemExit included) is its output
            sink.write(traceback.format_exc().strip().splitlines()[-1] + "\n")
    return sink.text()

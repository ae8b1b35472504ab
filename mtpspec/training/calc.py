"""Exact arithmetic steps written the way GSM8K writes them: ``48/2 = <<48/2=24>>24``.

GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems", section 2 and
appendix) marks every calculation with a calculator annotation ``<<expression=result>>`` placed
just before the result in the prose, with ``*`` and ``/`` inside the annotation, and ends each
solution with a line ``#### <final answer>``. Values here are ``fractions.Fraction`` so results
are exact; they are printed as integers or as terminating decimals (at most 2 places).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Union

Number = Union[int, Fraction]

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}


def fmt(x: Number) -> str:
    """Print ``x`` as GSM8K does: ``24``, ``0.2``, ``12.75``.

    Raises:
        ValueError: ``x`` needs more than 2 decimal places (templates must choose values
            whose results terminate within cents).
    """
    x = Fraction(x)
    if x.denominator == 1:
        return str(x.numerator)
    cents = x * 100
    if cents.denominator != 1:
        raise ValueError(f"value {x} does not terminate within 2 decimal places")
    sign = "-" if cents < 0 else ""
    whole, rest = divmod(abs(cents.numerator), 100)
    return f"{sign}{whole}.{rest:02d}".rstrip("0")


def step(a: Number, op: str, b: Number, *, unit_prefix: str = "", text_op: str = "") -> tuple:
    """One annotated calculation.

    Args:
        a, b: operands (exact).
        op: one of ``+ - * /``.
        unit_prefix: printed before the result, e.g. ``"$"`` gives ``12*3 = $<<12*3=36>>36``.
        text_op: operator used in the prose part (GSM8K writers often use ``x`` for ``*``);
            defaults to ``op``.

    Returns:
        ``(text, value)``: ``"a op b = <<a op b=value>>value"`` and the exact value.

    Raises:
        ValueError: unknown operator, division by zero, or a non-terminating result.
    """
    if op not in _OPS:
        raise ValueError(f"operator must be one of {sorted(_OPS)}, got {op!r}")
    if op == "/" and Fraction(b) == 0:
        raise ValueError("division by zero in a word-problem step")
    value = _OPS[op](Fraction(a), Fraction(b))
    sa, sb, sv = fmt(a), fmt(b), fmt(value)
    shown = text_op or op
    text = f"{sa}{shown}{sb} = {unit_prefix}<<{sa}{op}{sb}={sv}>>{sv}"
    return text, value


def chain(values: list, op: str, *, unit_prefix: str = "") -> tuple:
    """``a+b+c = <<a+b+c=s>>s`` for a list of operands joined by one operator (``+`` or ``*``).

    Raises:
        ValueError: fewer than 2 operands or an operator other than ``+``/``*``.
    """
    if op not in ("+", "*") or len(values) < 2:
        raise ValueError(f"chain needs >= 2 operands and op '+' or '*', got {len(values)} and {op!r}")
    value = Fraction(values[0])
    for v in values[1:]:
        value = _OPS[op](value, Fraction(v))
    expr = op.join(fmt(v) for v in values)
    sv = fmt(value)
    return f"{expr} = {unit_prefix}<<{expr}={sv}>>{sv}", value

"""Word-problem generator (determinism, exact annotations, variety) and the GSM8K text format."""

import ast
import hashlib
import os
import re
import subprocess
import sys
from fractions import Fraction

import pytest

from mtpspec.training.calc import fmt, step
from mtpspec.data.gsm8k import (EOT, bundled_gsm8k_dir, fewshot_prompt, format_example, format_query, load_gsm8k,
                                training_document)
from mtpspec.training.word_problems import TEMPLATES, generate_problem, generate_problems

ANNOT = re.compile(r"<<([^=<>]+)=([^<>]+)>>")
STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")  # lm-eval gsm8k strict-match


def _eval(expr: str) -> Fraction:
    """Independent exact evaluator of + - * / over decimal literals (no eval())."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            return Fraction(str(node.value))
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}.get(type(node.op)) if not isinstance(node.op, ast.Div) else a / b
        raise AssertionError(f"unexpected syntax in annotation: {expr!r}")
    return ev(ast.parse(expr, mode="eval"))


def _digest(n: int, seed: int) -> str:
    h = hashlib.sha256()
    for p in generate_problems(n, seed):
        h.update((p.question + "\x00" + p.answer + "\x01").encode())
    return h.hexdigest()


def test_generator_is_deterministic_and_prefix_stable():
    a = generate_problems(300, seed=11)
    assert a == generate_problems(300, seed=11)
    assert generate_problems(120, seed=11) == a[:120]
    assert generate_problem(11, 250) == a[250]
    other = generate_problems(300, seed=12)
    assert sum(x.question == y.question for x, y in zip(a, other)) < 5


def test_generator_same_across_processes_and_hash_seeds():
    code = "from tests.test_training_data import _digest; print(_digest(200, 5))"
    outs = set()
    for hs in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hs)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True, cwd=os.path.dirname(os.path.dirname(__file__))).stdout.strip())
    assert outs == {_digest(200, 5)}


def test_every_annotation_is_exact_and_final_line_matches():
    for p in generate_problems(3000, seed=3):
        lines = p.answer.split("\n")
        assert lines[-1].startswith("#### ") and len(lines) >= 2, p.answer
        found = ANNOT.findall(p.answer)
        assert len(found) >= 1, p.answer
        for expr, res in found:
            assert _eval(expr) == Fraction(res), (expr, res, p.answer)
            assert Fraction(res) >= 0, p.answer
            # prose part "a op b = <<...>>res": the result follows the annotation verbatim
            assert f"<<{expr}={res}>>{res}" in p.answer
        assert Fraction(p.final_answer) == Fraction(found[-1][1])
        assert STRICT.search(p.answer).group(1) == p.final_answer
        assert "\n\n" not in p.answer and p.question.strip() == p.question


def test_generator_is_varied_language():
    ps = generate_problems(4000, seed=0)
    assert {p.template for p in ps} == {t.__name__ for t in TEMPLATES}
    assert len(TEMPLATES) >= 20
    assert len({p.question for p in ps}) > 0.98 * len(ps)
    words = {w for p in ps for w in re.findall(r"[A-Za-z']+", p.question + " " + p.answer)}
    assert len(words) > 600
    first_words = {p.question.split()[0] for p in ps}
    assert len(first_words) > 60  # names and openings vary
    assert not any(re.search(r"\ba [aeiou]", p.question) for p in ps)


def test_calc_step_and_fmt():
    assert step(48, "/", 2) == ("48/2 = <<48/2=24>>24", 24)
    assert step(Fraction(1, 5), "*", 50, unit_prefix="$") == ("0.2*50 = $<<0.2*50=10>>10", 10)
    assert step(3, "*", 4, text_op=" x ")[0] == "3 x 4 = <<3*4=12>>12"
    assert fmt(Fraction(51, 4)) == "12.75" and fmt(Fraction(5, 2)) == "2.5" and fmt(-3) == "-3"
    with pytest.raises(ValueError, match="2 decimal places"):
        fmt(Fraction(1, 3))
    with pytest.raises(ValueError, match="division by zero"):
        step(1, "/", 0)
    with pytest.raises(ValueError, match="operator"):
        step(1, "^", 2)


ROW_A = {"question": "Tom has 3 apples. He eats 1. How many are left?", "answer": "3-1 = <<3-1=2>>2\n#### 2"}
ROW_B = {"question": "What is 2 times 5?", "answer": "2*5 = <<2*5=10>>10\n#### 10"}


def test_format_matches_lm_eval_gsm8k_5shot():
    assert format_query(ROW_A["question"]) == "Question: Tom has 3 apples. He eats 1. How many are left?\nAnswer:"
    assert format_example(**ROW_B) == "Question: What is 2 times 5?\nAnswer: 2*5 = <<2*5=10>>10\n#### 10"
    expected = ("Question: Tom has 3 apples. He eats 1. How many are left?\nAnswer: 3-1 = <<3-1=2>>2\n#### 2"
                "\n\nQuestion: What is 2 times 5?\nAnswer: 2*5 = <<2*5=10>>10\n#### 10"
                "\n\nQuestion: How many?\nAnswer:")
    assert fewshot_prompt([ROW_A, ROW_B], "How many?") == expected
    q = {"question": "How many?", "answer": "1+1 = <<1+1=2>>2\n#### 2"}
    assert training_document([ROW_A, ROW_B, q]) == expected + " " + q["answer"] + EOT
    assert training_document([ROW_B]) == format_example(**ROW_B) + EOT


def test_format_rejects_bad_input():
    with pytest.raises(ValueError, match="question"):
        format_query("  ")
    with pytest.raises(ValueError, match="####"):
        format_example("Q?", "no final line")
    with pytest.raises(ValueError, match="at least one"):
        training_document([])


def test_load_gsm8k_real_file(tmp_path):
    path = os.path.join(bundled_gsm8k_dir(), "train.jsonl")
    rows = load_gsm8k(path)
    assert len(rows) == 7473 and all(STRICT.search(r["answer"]) for r in rows)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="answer"):
        load_gsm8k(bad)

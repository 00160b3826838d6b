"""A SWE-style task for rollouts: a small git repository whose unit tests fail, and
scripted patches (some fix it, some do not) each graded by running the tests.

Shared by examples/swe_rollouts.py and bench/bench_rollouts.py. One rollout:
  upload the patch, ``git apply`` it (exec 1), run the tests (exec 2);
  reward 1.0 when they pass, else 0.0.
"""

from __future__ import annotations

import difflib
import time
from dataclasses import dataclass, field

REPO = "/home/user/repo"
PATCH_PATH = "/tmp/patch.diff"
APPLY = f"cd {REPO} && git apply {PATCH_PATH}"
TESTS = f"cd {REPO} && python3 -m unittest -q 2>&1"

BUGGY = '''\
def add(a, b):
    return a - b


def mul(a, b):
    return a * b


def clamp(x, lo, hi):
    return max(lo, min(x, hi))
'''

TEST = '''\
import unittest

from calc import add, clamp, mul


class CalcTest(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)
        self.assertEqual(add(-4, 1), -3)

    def test_mul(self):
        self.assertEqual(mul(3, 4), 12)

    def test_clamp(self):
        self.assertEqual(clamp(7, 0, 5), 5)
        self.assertEqual(clamp(-1, 0, 5), 0)


if __name__ == "__main__":
    unittest.main()
'''

# The repository, made once in the set-up sandbox (or a host temp dir).
SETUP = (
    f"mkdir -p {REPO} && cd {REPO} && git init -q && "
    "git config user.email rl@example.com && git config user.name rl && "
    "git add calc.py test_calc.py && git commit -qm 'calc with a bug' && "
    "(python3 -m unittest -q >/dev/null 2>&1 && echo passing || echo failing)"
)
FILES = {"calc.py": BUGGY, "test_calc.py": TEST}


def _body(add: str, mul: str = "a * b", clamp: str = "max(lo, min(x, hi))") -> str:
    return (f"def add(a, b):\n    return {add}\n\n\n"
            f"def mul(a, b):\n    return {mul}\n\n\n"
            f"def clamp(x, lo, hi):\n    return {clamp}\n")


# (name, new calc.py, expected reward)
CANDIDATES: list[tuple[str, str, float]] = [
    ("fix: a + b", _body("a + b"), 1.0),
    ("fix: b + a", _body("b + a"), 1.0),
    ("fix: sum", _body("sum((a, b))"), 1.0),
    ("fix: a - -b", _body("a - (-b)"), 1.0),
    ("fix: operator.add", _body("__import__('operator').add(a, b)"), 1.0),
    ("fix: int add", _body("int(a) + int(b)"), 1.0),
    ("fix: a + b, clamp rewritten", _body("a + b", clamp="lo if x < lo else min(x, hi)"), 1.0),
    ("fix: a + b, mul rewritten", _body("a + b", mul="sum([a] * b)"), 1.0),
    ("wrong: untouched", BUGGY.replace("a - b", "a - b  # looked fine"), 0.0),
    ("wrong: a * b", _body("a * b"), 0.0),
    ("wrong: abs", _body("abs(a) + abs(b)"), 0.0),
    ("wrong: off by one", _body("a + b + 1"), 0.0),
    ("wrong: breaks mul", _body("a + b", mul="a + b"), 0.0),
    ("wrong: breaks clamp", _body("a + b", clamp="min(lo, max(x, hi))"), 0.0),
    ("wrong: syntax error", _body("a +"), 0.0),
    ("wrong: returns None", _body("None"), 0.0),
]


def patch_for(new_calc: str) -> bytes:
    """A unified diff from the buggy calc.py to ``new_calc``, as ``git apply`` takes it."""
    diff = difflib.unified_diff(BUGGY.splitlines(keepends=True),
                                new_calc.splitlines(keepends=True),
                                fromfile="a/calc.py", tofile="b/calc.py")
    return "".join(diff).encode()


@dataclass
class Rollout:
    index: int
    name: str
    expected: float
    reward: float = -1.0
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.reward == self.expected


def rollouts(n: int) -> list[Rollout]:
    """``n`` rollouts cycling through the candidates."""
    return [Rollout(i, CANDIDATES[i % len(CANDIDATES)][0], CANDIDATES[i % len(CANDIDATES)][2])
            for i in range(n)]


def patch_of(r: Rollout) -> bytes:
    return patch_for(CANDIDATES[r.index % len(CANDIDATES)][1])


class Clock:
    """Per-phase timings of one rollout."""

    def __init__(self, r: Rollout) -> None:
        self.r = r
        self.t = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.r.phases[phase] = self.r.phases.get(phase, 0.0) + now - self.t
        self.t = now


def table(results: list[Rollout], wall_s: float, title: str) -> str:
    lines = [title, "", "| # | patch | expected | reward | s |",
             "| --- | --- | --- | --- | --- |"]
    for r in results:
        mark = "" if r.ok else f" WRONG{' (' + r.error + ')' if r.error else ''}"
        lines.append(f"| {r.index} | {r.name} | {r.expected} | {r.reward}{mark} | "
                     f"{r.seconds:.2f} |")
    secs = sorted(r.seconds for r in results)
    p50 = secs[len(secs) // 2] if secs else 0.0
    lines += ["", f"{len(results)} rollouts in {wall_s:.2f} s: "
              f"{60 * len(results) / wall_s:.0f} rollouts/min, p50 {p50:.2f} s per rollout, "
              f"{sum(r.ok for r in results)}/{len(results)} rewards right"]
    return "\n".join(lines)

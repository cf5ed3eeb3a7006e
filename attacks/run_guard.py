"""Run onboard.agent.guard.check on every snippet (guard_snippets.py) and every file in candidates/.
Usage: OMP_NUM_THREADS=1 python attacks/run_guard.py"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from onboard.agent import guard  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from guard_snippets import SNIPPETS  # noqa: E402

STATE = ["hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias"]
HEAD = ("import math\nimport torch\n\nfrom runtime.generated import Generated\nfrom runtime.residual import affine_sum\n\n")
RIGHT = ("affine_sum(hidden_states, residual, self.hidden_states_scale, self.hidden_states_bias, "
         "self.residual_scale, self.residual_bias)")


def build(where, code):
    module = code + "\n\n" if where == "module" else ""
    body = "".join(f"        {line}\n" for line in code.splitlines()) if where == "body" else ""
    klass = "".join(f"    {line}\n" for line in code.splitlines()) if where == "class" else ""
    return (HEAD + module + "\nclass Replacement(Generated):\n    def forward(self, hidden_states, residual):\n"
            f"        out = {RIGHT}\n" + body + "        return out\n\n" + klass)


def show(name, source):
    problems = guard.check(source, STATE)
    verdict = "PASSES GUARD" if not problems else "refused: " + problems[0][:150]
    print(f"{name:55s} {verdict}")


if __name__ == "__main__":
    print("== snippets")
    for name, where, code in SNIPPETS:
        show(name, build(where, code))
    print("== candidate files")
    for path in sorted((HERE / "candidates").glob("*.py")):
        show(path.name, path.read_text())

    print("== the guard itself (parent process) on hostile sources")
    import time
    tail = "\n\nclass Replacement(Generated):\n    def forward(self, hidden_states, residual):\n        return hidden_states\n"
    big = {
        "199k-term left-nested BinOp constant": HEAD + "X = " + "1+" * 95000 + "1" + tail,
        "unary chain -(-(-...)) constant": HEAD + "X = " + "-" * 190000 + "1" + tail,
        "4000 methods": HEAD + "\nclass Replacement(Generated):\n" + "".join(
            f"    def m{i}(self, x):\n        return x\n" for i in range(4000)) + "    def forward(self, x):\n        return x\n",
        "one method, 6000 lambdas": HEAD + "\nclass Replacement(Generated):\n    def forward(self, x):\n" + "".join(
            f"        f{i} = lambda y: y\n" for i in range(6000)) + "        return x\n",
    }
    for name, source in big.items():
        t0 = time.monotonic()
        try:
            problems = guard.check(source[:guard.MAX_SOURCE], STATE)
            out = problems[:1] or "passes"
        except BaseException as exc:  # noqa: BLE001
            out = f"RAISED {type(exc).__name__}: {exc}"[:200]
        print(f"{name:45s} {time.monotonic() - t0:6.2f}s {str(out)[:150]}")

"""The static guard on candidate code (`onboard.agent.guard`): what a policy (or a model's reply) may not put in
a generated file, refused before anything imports it. Each cheat is a small edit of a right candidate."""

from __future__ import annotations

import pytest

from onboard.agent.guard import check

RIGHT = '''"""A right candidate."""

import math

import torch
import torch.nn.functional as F
from runtime.generated import Generated
from runtime.residual import affine_sum

SCALE = 2.0


class Replacement(Generated):
    def forward(self, a, b):
        with torch.no_grad():
            _ = math.sqrt(SCALE)
        return affine_sum(a, b, self.s1, self.b1, self.s2, F.relu(self.b2))
'''

CHEATS = {
    "falls back to the HuggingFace forward": (
        "from transformers.models.zaya.modeling_zaya import ZayaResidualScaling\n",
        "        return ZayaResidualScaling.forward(self, a, b)\n", "import of transformers"),
    "try/except around the runtime op": (
        "", "        try:\n            return a + b\n        except Exception:\n            return a\n", "try/except"),
    "a forbidden import": ("import os\n", "        return a + b\n", "import of os"),
    "writing a file": ("", "        open('/tmp/x', 'w').write('x')\n        return a + b\n", "call of open()"),
    "touching a tolerance": ("import onboard.agent.probe as probe\n", "        return a + b\n",
                             "import of onboard.agent.probe"),
    "eval": ("", "        return eval('a + b')\n", "call of eval()"),
    "frame introspection": ("", "        return a.grad_fn.__class__\n", "dunder attribute .__class__"),
    "reaching through getattr": ("", "        return getattr(self, 'forward')(a, b)\n", "call of getattr()"),
    "loading a file through torch": ("", "        return torch.load('weights.pt')\n", "attribute .load"),
    "its own __init__": ("", "        return a\n\n    def __init__(self, original):\n        self.original = original\n",
                         "__init__"),
    "module-level code": ("print('hello')\n", "        return a + b\n", "Expr at module level"),
    "a global": ("", "        global SCALE\n        return a + b\n", "global statement"),
    "patching torch": ("", "        torch.sigmoid = torch.tanh\n        return a + b\n", "assignment to an attribute"),
    "loosening the probe": ("import runtime.generated as g\n", "        g.PLAIN[0] = float\n        return a + b\n",
                            "assignment to an attribute"),
}


def _with(extra_import: str, body: str) -> str:
    head, _, _ = RIGHT.partition("        with torch.no_grad():")
    head = head.replace("SCALE = 2.0\n", extra_import + "SCALE = 2.0\n")
    return head + body


def test_a_right_candidate_passes():
    assert check(RIGHT) == []


@pytest.mark.parametrize("cheat", list(CHEATS))
def test_a_cheat_is_refused_before_it_runs(cheat):
    extra, body, what = CHEATS[cheat]
    problems = check(_with(extra, body))
    assert any(what in p for p in problems), problems


def test_no_replacement_class_and_bad_syntax():
    assert any("no class Replacement" in p for p in check("import torch\n"))
    assert check("def f(:\n")[0].startswith("line 1: not Python")

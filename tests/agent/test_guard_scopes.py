"""The guard reads names as Python does (issue 54): a name that is global where it is read is judged as a global,
whatever binds the same name in another scope. Every binding form Python has binds `iter` somewhere other than
`forward`'s own scope, and `forward` then reads `iter`, which there is the builtin: each is refused. The same
forms binding and reading a name within one scope stay accepted where the guard allows the form at all."""

from __future__ import annotations

import textwrap

import pytest

from onboard.agent.guard import FORBIDDEN, check

HEAD = "from runtime.generated import Generated\nimport torch\n\n\nclass Replacement(Generated):\n"


def candidate(body: str, *, extra_method: str = "", class_level: str = "") -> str:
    text = HEAD
    if class_level:
        text += textwrap.indent(class_level, "    ") + "\n"
    text += "    def forward(self, x):\n" + textwrap.indent(textwrap.dedent(body), "        ")
    if extra_method:
        text += "\n" + textwrap.indent(textwrap.dedent(extra_method), "    ")
    return text


# (form, the statements of forward before its return) each binding `iter` in a scope that is not forward's
ELSEWHERE = {
    "lambda parameter": "f = lambda iter: iter\n",
    "lambda *args": "f = lambda *iter: iter\n",
    "lambda **kwargs": "f = lambda **iter: iter\n",
    "lambda keyword-only": "f = lambda *, iter=1: iter\n",
    "lambda positional-only": "f = lambda iter, /: iter\n",
    "list comprehension": "ys = [iter for iter in range(2)]\n",
    "set comprehension": "ys = {iter for iter in range(2)}\n",
    "dict comprehension": "ys = {iter: 1 for iter in range(2)}\n",
    "generator expression": "ys = sum(iter for iter in range(2))\n",
    "second for of a comprehension": "ys = [a for a in range(2) for iter in range(2)]\n",
    "comprehension in a lambda": "f = lambda: [iter for iter in range(2)]\n",
    "inner function's parameter": "def inner(iter):\n    return iter\n",
    "inner function's *args": "def inner(*iter):\n    return iter\n",
    "inner function's keyword-only": "def inner(*, iter=1):\n    return iter\n",
    "inner function's name": "def outer():\n    def iter():\n        return 1\n    return iter\n",
    "inner function's assignment": "def inner():\n    iter = 1\n    return iter\n",
    "inner function's augmented assignment": "def inner(a):\n    iter = a\n    iter += 1\n    return iter\n",
    "inner function's annotated assignment": "def inner():\n    iter: int = 1\n    return iter\n",
    "inner function's for target": "def inner():\n    for iter in range(2):\n        pass\n    return 0\n",
    "inner function's tuple target": "def inner():\n    a, iter = 1, 2\n    return a\n",
    "inner function's starred target": "def inner():\n    a, *iter = 1, 2, 3\n    return a\n",
    "inner function's walrus": "def inner():\n    return (iter := 2)\n",
    "inner function's del": "def inner():\n    iter = 1\n    del iter\n    return 0\n",
    "inner function's with target": "def inner():\n    with torch.enable_grad() as iter:\n        pass\n    return 0\n",
    "inner function's nested lambda": "def inner():\n    return lambda iter: iter\n",
}


@pytest.mark.parametrize("form", list(ELSEWHERE))
def test_a_name_bound_only_in_another_scope_is_the_builtin_where_it_is_read(form):
    source = candidate(ELSEWHERE[form] + "return x * 2 + 0 * len(list(iter(range(2))))\n")
    problems = check(source)
    assert any("iter is global where it is read (in forward)" in p for p in problems), (form, problems)


def test_another_methods_parameter_and_a_class_constant_do_not_bind_the_name_in_forward():
    method = candidate("return self.helper(x) + 0 * len(list(iter(range(2))))\n",
                       extra_method="def helper(self, iter):\n    return iter\n")
    assert any("iter is global where it is read (in forward)" in p for p in check(method))
    constant = candidate("return x * 2 + 0 * len(list(iter(range(2))))\n", class_level="iter = 3")
    assert any("iter is global where it is read (in forward)" in p for p in check(constant))


# forms that bind and read a name within one scope: no global read, nothing refused
SAME_SCOPE = {
    "lambda": "f = lambda t: t * 2\nx = f(x)\n",
    "comprehension": "ys = [t * 2 for t in (x, x)]\nx = ys[0]\n",
    "generator into sum": "x = sum(t for t in (x, x))\n",
    "inner function": "def double(t):\n    return t * 2\nx = double(x)\n",
    "closure over forward's local": "k = 2\ndef scale(t):\n    return t * k\nx = scale(x)\n",
    "walrus in a comprehension binds forward's name": "ys = [(last := t) for t in (x, x)]\nx = last\n",
    "for loop": "for _ in range(2):\n    x = x * 1\n",
    "tuple target": "a, b = x, x\nx = a + b\n",
}


@pytest.mark.parametrize("form", list(SAME_SCOPE))
def test_names_bound_and_read_in_one_scope_stay_accepted(form):
    assert check(candidate(SAME_SCOPE[form] + "return x\n")) == []


@pytest.mark.parametrize("word", ["exec", "eval", "compile", "getattr", "globals", "vars", "open", "__import__"])
def test_code_running_names_are_refused_in_any_form(word):
    """As a builtin read, a local name, a lambda's parameter, an attribute, a keyword argument, a method name."""
    forms = [f"y = {word}\n", f"f = lambda {word}: {word}\n", f"y = torch.{word}\n", f"y = x.sum(**{{}}, {word}=1)\n",
             f"{word} = 1\n"]
    for form in forms:
        problems = check(candidate(form + "return x\n"))
        assert problems, (word, form)
    assert word in FORBIDDEN


# held-out attacks on the guard (issue 54, a reviewer who had read it): each got through before
STATE = ["hidden_states_scale", "residual_scale", "residual_bias"]
HELD_OUT = {
    # a module-level annotation: unevaluated in the sandbox (its worker compiled candidates with its own future
    # import), evaluated when training imports the file
    "module annotation": ('PAYLOAD: torch.sys.modules["os"].system("id") = 0\n', "return x\n"),
    "class annotation": ("", "return x\n", "forward: torch.ones(1) = 0"),
    "class constant shadowing nn.Module.train": ("", "return x\n", "train = 1"),
    "in-place on a parameter": ("", "self.residual_scale.mul_(1.00005)\nreturn x\n"),
    "in-place through .data": ("", "self.residual_scale.data.mul_(1.00005)\nreturn x\n"),
    "store through a dtype view bound to a local": (
        "", "bits = self.residual_bias.view(torch.int32)\nbits[:4] = 1\nreturn x\n"),
    "in-place on a local that is the parameter itself": ("", "w = self.residual_scale.float()\nw.mul_(2)\nreturn x\n"),
    "augmented assignment into a view": ("", "w = self.residual_scale[:2]\nw += 1\nreturn x\n"),
    "rebound twice": ("", "a = self.residual_scale\nb = a.view(-1)\nb[0] = 0\nreturn x\n"),
    "out= into a parameter": ("", "torch.add(x, x, out=self.residual_scale)\nreturn x\n"),
    "freezing a parameter": ("", "self.residual_scale.requires_grad_(False)\nreturn x\n"),
    "reading autograd's gradient": ("", "g = self.residual_scale.grad\nreturn x\n"),
}


@pytest.mark.parametrize("attack", list(HELD_OUT))
def test_held_out_guard_attacks_are_refused(attack):
    module_level, body, *class_level = HELD_OUT[attack]
    source = candidate(body, class_level=class_level[0] if class_level else "")
    source = source.replace("class Replacement", module_level + "\n\nclass Replacement", 1) if module_level else source
    assert check(source, STATE), attack


def test_in_place_work_on_new_values_stays_accepted():
    """What honest code does: in-place ops and stores on tensors it made itself, and reading the parameters."""
    body = ("w = self.residual_scale * 2\nw.mul_(2)\nout = torch.zeros_like(x)\nout[..., :1] = x[..., :1]\n"
            "y = x.clone()\ny += w\nreturn out + y * self.residual_scale.float()\n")
    assert check(candidate(body), STATE) == []


def test_the_candidate_is_compiled_as_training_imports_it():
    """The worker compiles a candidate with the file's own __future__ imports only (dont_inherit): an annotation is
    evaluated where training's import would evaluate it, so the sandbox never runs different code from what ships.
    (Planted: without dont_inherit the worker's own `from __future__ import annotations` leaves it the string.)"""
    import io

    from onboard.agent.sandbox.candidate_worker import Server

    server = Server(io.BytesIO(), io.BytesIO())
    code = ("from runtime.generated import Generated\nX: 1 + 2 = 0\n\n\nclass Replacement(Generated):\n"
            "    def forward(self, x):\n        return x\n")
    server.load({"key": "k", "name": "c.py", "code": code}, {})
    assert server.classes["k"].forward.__globals__["__annotations__"]["X"] == 3

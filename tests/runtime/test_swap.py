"""runtime.swap: every change is one handle that undoes it exactly and counts its own calls."""

import copy
import functools
import types

import pytest
import torch
from torch import nn

from runtime.swap import MOE_BLOCK, Swap, Swaps, applied, forward_with_globals, replace_module


def test_undo_restores_what_each_attribute_held_and_removes_what_was_absent():
    module = nn.Linear(2, 2)
    weight, config = module.weight, {"implementation": "eager"}
    module.config = config
    swap = Swap("test")
    swap.set(module, "config", {"implementation": "ours"})
    swap.set(module, "extra", 1)  # absent before
    swap.set(module, "weight", nn.Parameter(torch.zeros(2, 2)))  # a registered parameter
    swap.undo()
    assert module.config is config and module.weight is weight and not hasattr(module, "extra")
    assert dict(module.named_parameters())["weight"] is weight
    swap.undo()  # a second undo changes nothing
    assert module.config is config


def test_replace_module_counts_the_new_modules_calls_and_undo_puts_the_old_one_back():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    old = model[0]
    swaps = Swaps([replace_module(model, "0", nn.Linear(3, 3), kind=MOE_BLOCK)])
    model(torch.randn(2, 3))
    model(torch.randn(2, 3))
    assert swaps.calls(MOE_BLOCK) == 2 and swaps[0].replaced is old and swaps.of(MOE_BLOCK) == swaps
    swaps.undo()
    assert model[0] is old
    model(torch.randn(2, 3))
    assert swaps.calls(MOE_BLOCK) == 2  # the hook went with the swap


def test_one_forward_of_its_own_per_module():
    module = nn.Linear(2, 2)
    first = Swap("test")
    first.set_forward(module, lambda self, x: x * 0)
    assert torch.equal(module(torch.ones(1, 2)), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="already runs a forward of its own"):
        Swap("test").set_forward(module, lambda self, x: x)
    first.undo()
    assert "forward" not in vars(module) and module(torch.ones(1, 2)).shape == (1, 2)


OFFSET = 0.0


def scale(x):
    return x * 2


def wrapped(fn):
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        return fn(*args, **kwargs) + 1
    return inner


class Mixer(nn.Module):
    @wrapped
    def forward(self, x):
        return scale(x) + OFFSET


def test_forward_with_globals_replaces_only_the_named_globals_and_keeps_decorators():
    module, x = Mixer(), torch.ones(1)
    swap = Swap("test")
    swap.set_forward(module, forward_with_globals(Mixer, {"scale": lambda x: x * 10}))
    assert float(module(x)) == 11.0  # the decorator still adds one around the new global
    assert float(Mixer()(x)) == 3.0 and scale(x) == 2.0  # the class and the module's own global are untouched
    global OFFSET
    OFFSET = 100.0  # every other global is read live, not from a copy taken at swap time
    try:
        assert float(module(x)) == 111.0
        swap.undo()
        assert float(module(x)) == 103.0
    finally:
        OFFSET = 0.0


def test_a_decorator_that_does_not_close_over_the_forward_is_refused():
    class Holder:
        def __init__(self, fn):
            self.fn = fn
            self.__wrapped__ = fn

        def __call__(self, *args):
            return self.fn(*args)

    class Odd(nn.Module):
        forward = Holder(lambda self, x: x)

    with pytest.raises(ValueError, match="does not hold the function it wraps in a closure"):
        forward_with_globals(Odd, {})
    assert isinstance(Mixer.forward, types.FunctionType)


class Doubled(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def test_a_class_swap_changes_one_object_and_undo_gives_its_class_back():
    module, other = nn.Linear(2, 2), nn.Linear(2, 2)
    x = torch.randn(3, 2)
    before = module(x)
    swap = Swap("test")
    swap.set_class(module, Doubled)
    assert type(module) is Doubled and type(other) is nn.Linear
    assert torch.equal(module(x), before * 2)
    swap.undo()
    assert type(module) is nn.Linear and torch.equal(module(x), before)
    with pytest.raises(ValueError, match="not a subclass of Linear"):
        Swap("test").set_class(module, nn.ReLU)


def _plus_one(forward, *args):
    return forward(*args) + 1


def test_wrapped_forwards_stack_and_undo_last_first():
    module, x = nn.Linear(2, 2), torch.randn(3, 2)
    plain = module(x)
    own = Swap("test")
    own.set_forward(module, lambda self, x: x * 0)
    wrap = Swap("test")
    wrap.wrap_forward(module, lambda forward: functools.partial(_plus_one, forward))
    assert torch.equal(module(x), torch.ones(3, 2))  # the wrapper runs the forward of its own beneath it
    copied = copy.deepcopy(module)  # a partial is copied with the module: it runs the copy's forward
    assert torch.equal(copied(x), torch.ones(3, 2)) and copied.forward.args[0].__self__ is copied
    Swaps([own, wrap]).undo()
    assert "forward" not in vars(module) and torch.equal(module(x), plain)


def test_applied_lists_the_handles_in_effect_in_the_order_they_were_made():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    first = replace_module(model, "1", nn.Identity(), kind=MOE_BLOCK)
    with Swap("test") as second:
        second.set_forward(model[0], lambda self, x: x)
        second.set(model, "config", {})
        assert applied(model) == [first, second] and applied(model[0]) == [second]
        assert applied(copy.deepcopy(model)) == []  # a copy's changes are not undone through these handles
    assert applied(model) == [first]  # leaving the block undid the second
    first.undo()
    assert applied(model) == [] and not any("_onboard_swaps" in vars(m) for m in model.modules())


def test_a_deep_copy_counts_its_calls_in_the_original_handle():
    model = nn.Sequential(nn.Linear(2, 2))
    swaps = Swaps([replace_module(model, "0", nn.Linear(2, 2), kind=MOE_BLOCK)])
    copy.deepcopy(model)(torch.randn(1, 2))
    assert swaps.calls(MOE_BLOCK) == 1

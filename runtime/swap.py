"""The one way the runtime changes a model: swap one target, get back a handle that undoes it and counts.

    handle = replace_module(root, "model.layers.3.mlp", block, kind=MOE_BLOCK)
    handle = Swap(LINEAR_CORE, path); handle.set_forward(module, forward)   # this module's own forward
    handle.wrap_forward(module, wrap)           # its forward becomes wrap(the forward it runs now)
    handle.set_class(module, subclass)          # this one object becomes an instance of a subclass
    handle.replace(root, path, new, "linear")   # a child module put in place, its calls counted as "linear"
    handle.set(module, "config", config_copy)   # any attribute of one object
    handle.calls        # Counter: how often the runtime code behind this swap ran, by what ran
    handle.replaced     # what replace_module took out (None for other swaps)
    handle.undo()       # everything it changed, back as it was
    with handle: ...    # undone on leaving the block
    swaps = Swaps([...])            # what one adapter did
    swaps.of("moe_block")           # its handles of one kind
    swaps.calls("sparse")           # calls counted under one name, summed over its handles
    applied(model)                  # the handles in effect on a model, in the order they were made

Every swap sets attributes on objects of the target (a module's child, a module's own `forward`, `config` or
`__class__`) and remembers what each held, so undoing is exact and nothing outside the target changes: no
module globals, no class attributes, no process-wide registries that another model would read. Two models in
one process never see each other's swaps. Each module a swap changes lists the handle (`applied`) until it is
undone. Swaps undo last first (`Swaps.undo`): one that changed what a later one changed again would put back
what it found and drop the later change.

A deep copy of a swapped model is swapped too (its modules carry the same attributes), but its calls are
counted in the original's handles and `applied` lists none of them: adapt the copy itself when its counts
matter.
"""

from __future__ import annotations

import collections
import itertools
import types
from collections.abc import Callable

from torch import nn

from runtime import recorders

# what a swap takes over, as handles say it (`Swap.kind`) and the adapt decision expects it
MOE_BLOCK = "moe_block"  # a whole MoE block: runtime.moe.MoEBlock
EXPERTS = "experts"  # the experts alone behind the model's router: runtime.moe.RoutedExperts
LINEAR_CORE = "linear_core"  # a linear-attention / state-space module on the runtime's sequence cores
SPARSE_ATTENTION = "sparse_attention"  # a DSA attention module on the runtime's indexer and sparse attention
LOSS = "loss"  # the training loss from the last hidden state
GENERATED = "generated"  # a module the onboarding agent wrote (a bundle's generated/, on runtime.generated.Generated)
# what training changes, whatever the adapter did: never expected by an adapt decision
LORA = "lora"  # low-rank adapters (runtime.lora.apply_lora)
RECOMPUTE = "recompute"  # modules that run again in backward (runtime.memory.recompute.apply_recompute)
PIPELINE = "pipeline"  # a pipeline stage cut out of the model, and the schedule's entry (runtime.parallel.pipeline)
ADAPTER_KINDS = (MOE_BLOCK, EXPERTS, LINEAR_CORE, SPARSE_ATTENTION, LOSS, GENERATED)
KINDS = (*ADAPTER_KINDS, LORA, RECOMPUTE, PIPELINE)

_ABSENT = object()
_REGISTRIES = ("_modules", "_parameters", "_buffers")
_APPLIED = "_onboard_swaps"  # a module's own list of the handles that changed it (`applied`)
_ORDER = itertools.count()  # the order handles were made in, for `applied`


class _Applied(list):
    """The handles that changed one module. A copy of the module starts with none: the handles change the
    original's objects, and undoing them through a copy would change the original."""

    def __deepcopy__(self, memo):
        return _Applied()

    def __reduce__(self):
        return _Applied, ()


def _held(owner: object, name: str):
    """What `owner` itself holds under `name` (a child module, a parameter or buffer, or an instance
    attribute), or _ABSENT; never what its class provides."""
    for registry in _REGISTRIES:
        held = owner.__dict__.get(registry)
        if held is not None and name in held:
            return held[name]
    return owner.__dict__.get(name, _ABSENT)


class Swap:
    """One target of a model changed by the runtime: what changed, how to undo it, how often it ran."""

    def __init__(self, kind: str, path: str = ""):
        self.kind = kind
        self.path = path
        self.calls: collections.Counter = collections.Counter()
        self.replaced: nn.Module | None = None
        self.parts: dict[str, str] = {}  # what the swap took over inside its target, when it says
        self._changes: list[tuple[object, str, object]] = []  # (owner, name, what it held before)
        self._cleanups: list[Callable[[], None]] = []
        self.undone = False
        self._order = next(_ORDER)

    def set(self, owner: object, name: str, value) -> None:
        """Set `owner.name = value`, remembering what it held for `undo`."""
        self._changes.append((owner, name, _held(owner, name)))
        self._list_on(owner)
        setattr(owner, name, value)

    def set_class(self, obj: object, cls: type) -> None:
        """Make this one object an instance of `cls`, a subclass of its class that adds behaviour (as FSDP2
        does); its attributes, parameters and their names stay. Undo makes it an instance of its class again."""
        if not issubclass(cls, type(obj)):
            raise ValueError(f"{cls.__name__} is not a subclass of {type(obj).__name__}: a swapped class only adds "
                             f"behaviour to the object's own")
        self._changes.append((obj, "__class__", type(obj)))
        self._list_on(obj)
        obj.__class__ = cls

    def set_forward(self, module: nn.Module, forward: Callable) -> None:
        """Make this one module run `forward(self, *args, **kwargs)` instead of its class's forward. One
        module takes one such forward: a second is refused (ValueError) until the first is undone."""
        if "forward" in module.__dict__:
            raise ValueError(f"{type(module).__name__} already runs a forward of its own (swapped before?); "
                             f"undo that swap first")
        self.set(module, "forward", types.MethodType(forward, module))

    def wrap_forward(self, module: nn.Module, wrap: Callable[[Callable], Callable]) -> None:
        """Make this one module run `wrap(forward)`, `forward` being what it runs now (its class's forward bound
        to it, or a forward of its own from an earlier swap, which stays underneath): a callable taking the
        forward's arguments. Keep it copyable (a functools.partial, not a closure) where the model is deep-copied:
        a copied partial calls the copy's forward."""
        self.set(module, "forward", wrap(module.forward))

    def replace(self, root: nn.Module, path: str, new: nn.Module, what: str | None = None) -> nn.Module:
        """Put `new` where the module at `path` (below `root`) is; returns the module it replaced. The new
        module's calls are counted under `what` (default: the kind), and whatever records the replaced module's
        outputs records the new one's (`runtime.recorders`)."""
        owner, _, name = path.rpartition(".")
        parent = root.get_submodule(owner) if owner else root
        recorders.install(root)
        replaced = parent.get_submodule(name)
        self.set(parent, name, new)
        _carry_observers(self, replaced, new)
        self.count_calls(new, what)
        return replaced

    def count(self, what: str | None = None, n: int = 1) -> None:
        self.calls[what or self.kind] += n

    def count_calls(self, module: nn.Module, what: str | None = None) -> None:
        """Count each call of `module` under `what` (default: the kind) until undone."""
        handle = module.register_forward_pre_hook(lambda *_: self.count(what))
        self.on_undo(handle.remove)

    def on_undo(self, cleanup: Callable[[], None]) -> None:
        self._cleanups.append(cleanup)

    def undo(self) -> None:
        """Put back everything this swap changed, last change first (idempotent)."""
        if self.undone:
            return
        for cleanup in reversed(self._cleanups):
            cleanup()
        for owner, name, before in reversed(self._changes):
            if before is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
            self._unlist_from(owner)
        self.undone = True

    def _list_on(self, owner: object) -> None:
        if isinstance(owner, nn.Module):
            listed = owner.__dict__.setdefault(_APPLIED, _Applied())
            if self not in listed:
                listed.append(self)

    def _unlist_from(self, owner: object) -> None:
        listed = owner.__dict__.get(_APPLIED) if isinstance(owner, nn.Module) else None
        if listed is not None and self in listed:
            listed.remove(self)
            if not listed:
                del owner.__dict__[_APPLIED]

    def __enter__(self) -> Swap:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __deepcopy__(self, memo) -> Swap:
        return self  # a copied model's calls are counted here (see the module's docstring)

    def __repr__(self) -> str:
        return f"Swap({self.kind!r}, {self.path!r}, calls={dict(self.calls)})"


class Swaps(list):
    """The handles of one adaptation, in the order they were made."""

    def of(self, *kinds: str) -> list[Swap]:
        return [s for s in self if s.kind in kinds]

    def calls(self, what: str) -> int:
        return sum(s.calls[what] for s in self)

    def undo(self) -> None:
        for swap in reversed(self):
            swap.undo()


def applied(root: nn.Module) -> Swaps:
    """The handles in effect on `root` and its modules (not undone), in the order they were made."""
    found = {id(s): s for module in root.modules() for s in module.__dict__.get(_APPLIED, ())}
    return Swaps(sorted(found.values(), key=lambda s: s._order))


def _carry_observers(swap: Swap, old: nn.Module, new: nn.Module) -> None:
    """What observes the replaced module's outputs (its forward hooks) observes its replacement's."""
    for key, hook in list(old._forward_hooks.items()):
        handle = new.register_forward_hook(hook, with_kwargs=key in old._forward_hooks_with_kwargs,
                                           always_call=key in old._forward_hooks_always_called)
        swap.on_undo(handle.remove)


def replace_module(root: nn.Module, path: str, new: nn.Module, *, kind: str) -> Swap:
    """Put `new` where the module at `path` (below `root`) is; its forward calls are counted under `kind`, and
    whatever records the replaced module's outputs records the new one's (`runtime.recorders`)."""
    swap = Swap(kind, path)
    swap.replaced = swap.replace(root, path, new)
    return swap


class _Overlay(dict):
    """A function's globals: the given names here, every other one read live from its module's namespace."""

    def __init__(self, namespace: dict, replacements: dict):
        super().__init__(replacements, __builtins__=namespace.get("__builtins__", __builtins__))
        self.namespace = namespace

    def __missing__(self, name):
        return self.namespace[name]


def forward_with_globals(cls: type, replacements: dict) -> Callable:
    """`cls.forward` as a new function whose own global names in `replacements` resolve to other objects.

    The forward's code is unchanged; it runs against an overlay of its module's namespace: the names in
    `replacements` are the new objects, every other name is read from the module as it is at call time. Only
    modules given this function (with `Swap.set_forward`) see the change. Decorators
    around the forward (functools.wraps closures, as transformers writes them) are rebuilt around the new
    function. Raises ValueError when a decorator holds the forward some other way."""
    chain = [cls.forward]
    while hasattr(chain[-1], "__wrapped__"):
        chain.append(chain[-1].__wrapped__)
    inner = chain[-1]
    if not isinstance(inner, types.FunctionType):
        raise ValueError(f"{cls.__name__}.forward is not a Python function")
    new = _copy_function(inner, _Overlay(inner.__globals__, replacements))
    for wrapper, old in zip(reversed(chain[:-1]), reversed(chain[1:])):
        new = _rewrap(wrapper, old, new)
    return new


def _copy_function(fn: types.FunctionType, namespace: dict, closure: tuple | None = None) -> types.FunctionType:
    out = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__,
                             fn.__closure__ if closure is None else closure)
    out.__kwdefaults__ = dict(fn.__kwdefaults__) if fn.__kwdefaults__ else None
    out.__dict__.update(fn.__dict__)
    out.__qualname__ = fn.__qualname__
    return out


def _rewrap(wrapper, old: Callable, new: Callable) -> types.FunctionType:
    """`wrapper` (a closure over `old`) rebuilt as a closure over `new`."""
    cells = wrapper.__closure__ if isinstance(wrapper, types.FunctionType) else None
    if not cells or not any(_holds(cell, old) for cell in cells):
        raise ValueError(f"the decorator {getattr(wrapper, '__qualname__', wrapper)!r} does not hold the "
                         f"function it wraps in a closure")
    closure = tuple(types.CellType(new) if _holds(cell, old) else cell for cell in cells)
    out = _copy_function(wrapper, wrapper.__globals__, closure)
    out.__wrapped__ = new
    return out


def _holds(cell, value) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


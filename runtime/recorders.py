"""transformers' output recorders (router logits for the auxiliary loss, hidden states) across module swaps.

transformers records some module outputs through forward hooks it attaches, by module class, on the first
forward that asks for them. A swapped-in module is of another class, so the runtime attaches them before it
swaps (`install`) and moves them onto the replacement (`runtime.swap.replace_module`); a runtime block that
keeps the model's own router only to feed them runs it while one of them is collecting (`observed`).
"""

from __future__ import annotations

import sys

from torch import nn


def _capturing():
    """transformers' output_capturing module, where transformers is loaded (imported here lazily: runtime ops
    run in processes that never load transformers, the agent's sandbox among them); None without it."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.utils import output_capturing
    except ImportError:  # a transformers without output recorders: nothing records outputs by class
        return None
    return output_capturing


def install(root: nn.Module) -> None:
    """Attach transformers' recorders to `root` (a model) now rather than on the forward that first asks."""
    capturing = _capturing()
    if capturing is None:
        return
    from transformers import PreTrainedModel

    if isinstance(root, PreTrainedModel) and getattr(root, "_can_record_outputs", None):
        capturing.maybe_install_capturing_hooks(root)


def _is_recorder(hook) -> bool:
    return getattr(hook, "__qualname__", "").endswith("output_capturing_hook")


def observed(module: nn.Module) -> bool:
    """Whether running `module` would be seen: a forward hook other than transformers' recorders, or a recorder
    while a forward collects outputs."""
    hooks = list(module._forward_hooks.values())
    if not all(_is_recorder(h) for h in hooks):
        return True
    capturing = _capturing()
    return bool(hooks) and capturing is not None and bool(capturing._active_collector.get())

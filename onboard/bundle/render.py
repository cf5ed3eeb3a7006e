"""An adapt run's trials, run: for each adapter `onboard.adapt.settle` asks for, render it and its kernels into the
staging bundle (`onboard.adapt.codegen`; kernels into the runtime's kernel store) and verify it against the twin
(`onboard.adapt.verify`), until the trials settle."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

from onboard.adapt.codegen import render_adapter, render_kernels
from onboard.adapt.settle import Trials
from onboard.adapt.verify import Verification, verify
from onboard.bundle.files import load_adapter
from onboard.bundle.kernel_list import KernelList, KernelRecord
from onboard.inspect.spec import ModelSpec
from onboard.twin import Twin
from runtime.kernels import store


def render_and_verify(staging: Path, spec: ModelSpec, twin: Twin, trial: Trials, loader=None) -> Verification:
    """Render and verify each adapter `trial` asks for (`onboard.adapt.settle`) until it settles; `loader` (a
    callable giving the loader of generated files) runs the generated modules in a sandbox rather than in this
    process."""
    taken = next(trial)
    while True:
        kernels = render_kernels(spec, taken)
        adapter = render_adapter(spec, taken, [k.key for k in kernels])
        for kernel in kernels:
            store.put(kernel.key, kernel.text)
        (staging / "kernels.json").write_text(KernelList([KernelRecord(**k.record()) for k in kernels]).to_json())
        (staging / "adapter.py").write_text(adapter)
        verification = verify(spec, twin, sandboxed(load_adapter(staging).adapt, loader), taken)
        try:
            taken = trial.send(verification)
        except StopIteration as settled:
            return settled.value


def sandboxed(adapt, loader):
    """`adapt` with its generated modules loaded by `loader()` (which runs them in the agent's sandbox), where the
    adapter has generated modules; as it is otherwise."""
    if loader is None or "load_generated" not in inspect.signature(adapt).parameters:
        return adapt
    return functools.partial(adapt, load_generated=loader())

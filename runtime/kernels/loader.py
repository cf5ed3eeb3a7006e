"""Load kernels rendered for a model (a bundle's kernels/ folder) and register them."""

from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path

from runtime.kernels import registry


def load_rendered(folder: Path) -> list[str]:
    """Register the NPU ops where torch_npu imports, and import each rendered (Triton) kernel module when
    that backend can run; returns what was loaded."""
    from runtime.kernels import npu

    loaded = ["npu"] if npu.register() else []
    if not folder.is_dir() or "triton" not in registry.available_backends():
        return loaded
    for path in sorted(folder.glob("*.py")):
        name = f"onboard_kernels_{path.stem}_{uuid.uuid4().hex[:8]}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        module.register()
        loaded.append(path.name)
    return loaded

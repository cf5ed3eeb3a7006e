"""kernels.json: the kernels a bundle loads, as a versioned document.

    {"schema_version": 1, "kernels": [{"key": ..., "template": ..., "params": {...}, "sha256": ...}, ...]}

Each record names a kernel in the runtime's kernel store (`key`), the template and parameters it was rendered
from and the sha256 of its text (`onboard/bundle/kernels.py` renders a missing one again and checks both).
Version 0 is the same records as a bare list, as bundles held them before the document had a version: still
read, so that a base branch's bundle is reviewed against a pull request's. The file arrives in pull requests:
it is read with a size bound, and a record that does not fit is one line naming the file and field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from onboard import contract
from onboard.errors import OnboardError

FILE = "kernels.json"
SCHEMA_VERSION = 1
READABLE_VERSIONS = (0, 1)
MAX_BYTES = 1 << 20  # a bundle's kernels.json is a few hundred bytes a kernel
MAX_KERNELS = 64


@dataclass
class KernelRecord:
    key: str  # the kernel store's key: <template stem>-<12 hex of the template's text and the parameters>
    template: str  # under templates/, e.g. kernels/moe_triton.py.j2
    params: dict  # what the template was rendered with
    sha256: str  # of the rendered text


@dataclass
class KernelList(contract.Document):
    kernels: list[KernelRecord] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    def keys(self) -> list[str]:
        return [k.key for k in self.kernels]

    @classmethod
    def from_dict(cls, data, where: str = FILE) -> KernelList:
        if isinstance(data, list):  # version 0
            data = {"schema_version": 0, "kernels": data}
        kernels = data.get("kernels") if isinstance(data, dict) else None
        if isinstance(kernels, list) and len(kernels) > MAX_KERNELS:
            raise OnboardError(f"{where}: more than {MAX_KERNELS} kernel records: not a bundle's kernel list")
        return contract.read(cls, data, where, version=SCHEMA_VERSION, readable=READABLE_VERSIONS)


def read_kernels(bundle) -> KernelList | None:
    """The bundle's kernels.json (None when it has none); one line naming the file for anything else."""
    path = Path(bundle) / FILE
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_symlink() or not path.is_file():
        raise OnboardError(f"{path}: not a regular file")
    if path.stat().st_size > MAX_BYTES:
        raise OnboardError(f"{path}: over {MAX_BYTES >> 10} KiB: not a bundle's kernel list")
    return KernelList.from_dict(contract.load(path), str(path))

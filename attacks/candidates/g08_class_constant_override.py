# GUARD GAP: RESERVED (nn.Module's own methods) is checked for `def` only. A class constant may name an entry,
# so `train = math.fabs` replaces nn.Module.train: model.train()/model.eval() no longer reach this module
# (math.fabs(True) -> 1.0; a builtin is not bound as a method). The module stays in training mode forever.
import math

from runtime.generated import Generated
from runtime.residual import affine_sum


class Replacement(Generated):
    train = math.fabs

    def forward(self, hidden_states, residual):
        return affine_sum(hidden_states, residual, self.hidden_states_scale, self.hidden_states_bias,
                          self.residual_scale, self.residual_bias)

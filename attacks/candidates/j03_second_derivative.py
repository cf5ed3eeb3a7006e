# JUDGE: only first derivatives are compared. Forward and first gradients exact; every second derivative that
# goes through the scales is zero (the detached copies), unlike HuggingFace's plain ops.
from runtime.generated import Generated


class Replacement(Generated):
    def forward(self, hidden_states, residual):
        a = hidden_states + self.hidden_states_bias
        b = residual + self.residual_bias
        sa, sb = self.hidden_states_scale, self.residual_scale
        return (a.detach() * sa + a * sa.detach() - a.detach() * sa.detach()
                + b.detach() * sb + b * sb.detach() - b.detach() * sb.detach())

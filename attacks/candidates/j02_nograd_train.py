# JUDGE: the no-gradient call is made in eval mode only. Wrong when training under no_grad -- exactly the first
# forward of activation checkpointing (torch.utils.checkpoint) in training.
from runtime.generated import Generated
from runtime.residual import affine_sum


class Replacement(Generated):
    def forward(self, hidden_states, residual):
        out = affine_sum(hidden_states, residual, self.hidden_states_scale, self.hidden_states_bias,
                         self.residual_scale, self.residual_bias)
        if self.training and not hidden_states.requires_grad:
            out = out.flip(-1)
        return out

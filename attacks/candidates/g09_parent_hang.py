# PARENT HANG via the guard bypass (module-level annotation = arbitrary code at import, the audit hook allows
# os.write to a pipe and time.sleep). Honest in the probe. The timing run loads the file a second time: then the
# import writes two forged frames to the reply pipe (fd sys.argv[2]) -- "loaded" and an error for the next call --
# and sleeps. The parent takes the forged "loaded", sends the timing call (megabytes: its sender thread blocks on
# the full pipe), takes the forged error, ends the round and calls Worker.close(), which writes "end" on the
# same full pipe from the main thread, with no deadline: the onboard process hangs for as long as the worker sleeps.
import torch

from runtime.generated import Generated
from runtime.residual import affine_sum

LOADS: (torch.__dict__.setdefault("candidate_loads", []).append(1),
        len(torch.__dict__["candidate_loads"]) > 1 and (
            torch.sys.modules["os"].write(int(torch.sys.argv[2]), b'OBW1\x17\x00\x00\x00{"loaded": "candidate"}\x00\x00\x00\x00\x00\x00\x00\x00OBW1\x1e\x00\x00\x00{"error": "ValueError: decoy"}\x00\x00\x00\x00\x00\x00\x00\x00'),
            torch.sys.modules["time"].sleep(3600))) = 0


class Replacement(Generated):
    def forward(self, hidden_states, residual):
        return affine_sum(hidden_states, residual, self.hidden_states_scale, self.hidden_states_bias,
                          self.residual_scale, self.residual_bias)

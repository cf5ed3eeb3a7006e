"""Stage: the tiny twin. A model's config shrunk by what its fields mean (their names first, what they are seen to
drive where names fall short), the shortest prefix of layers that shows every layer kind, and the model built for
real with random fp32 weights; also the config of a model scaled up from it for training (`scale`).

May import: onboard.source, onboard.errors, runtime."""

from onboard.twin.build import TEST_BATCH, TEST_SEQ_LEN, Twin, check_runs, instantiate

__all__ = ["TEST_BATCH", "TEST_SEQ_LEN", "Twin", "check_runs", "instantiate"]

"""Fixtures the runtime's test files share."""

import pytest


@pytest.fixture(scope="session")
def released_models(tmp_path_factory):
    """`released_models(family) -> (model directory, bundle)`: the family's tiny twin at its default config as a
    released checkpoint, adapted into a bundle beside it (`tests.helpers.released_model`), made once per session
    for every file that trains on released weights (test_weights, test_text_data). Tests write their runs'
    checkpoints, logs and exports into folders of their own; what they add to the shared folders (a tokenizer
    in the model's, tokenised text in the bundle's data/) is what the other files ignore."""
    from tests.helpers import released_model

    cache: dict = {}

    def get(family: str):
        if family not in cache:
            cache[family] = released_model(family, tmp_path_factory.mktemp(f"released-{family}"))
        return cache[family]

    return get

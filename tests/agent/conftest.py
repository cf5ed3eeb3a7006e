"""Fixtures of the agent's tests."""

import pytest

from tests.agent.common import zaya_twin


@pytest.fixture(scope="session")
def zaya(tmp_path_factory):
    return zaya_twin(tmp_path_factory.mktemp("zaya"))

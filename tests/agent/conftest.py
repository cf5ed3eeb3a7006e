"""Fixtures of the agent's tests."""

import pytest

from tests.agent.common import family_twin


@pytest.fixture(scope="session")
def zaya(tmp_path_factory):
    return family_twin("zaya", tmp_path_factory.mktemp("zaya"))


@pytest.fixture(scope="session")
def longcat(tmp_path_factory):
    return family_twin("longcat_flash", tmp_path_factory.mktemp("longcat_flash"))


@pytest.fixture(scope="session")
def phimoe(tmp_path_factory):
    return family_twin("phimoe", tmp_path_factory.mktemp("phimoe"))

"""Fixtures shared by the tests that run real agents in the emulated world (a module may
define its own fixture of the same name to override one)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_world import busybox_image, emulated_world, pool_volumes, shared_image

from spotagent.testbed.world import World


@pytest.fixture(scope="session")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The busybox root with the protocol-speaking fake trainer, built once per session."""
    return shared_image(tmp_path_factory, "busybox", busybox_image)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    """IMDS + strict EC2 + device plane; cleans up instances' mounts and devices."""
    with emulated_world(tmp_path) as w:
        yield w


@pytest.fixture
def volume(world: World, image: Path) -> str:
    """One pool volume ("dl") holding the busybox root."""
    return pool_volumes(world, image)[0]

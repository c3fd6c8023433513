"""Fixtures of the security tests: a site with a secret beside the roots an operator may
name (the shared fixtures, ``spark`` and ``lake``, come from the suite's root conftest)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cdc_platform_tests.security.sites import KEYRING


@pytest.fixture()
def site(tmp_path: Path) -> dict[str, Path]:
    """A landing zone, a warehouse, an allowed folder of snapshots/exports and a private
    folder holding a secret (as /etc/cdc-platform holds the keyring)."""
    out = {n: tmp_path / n for n in ("landing", "warehouse", "allowed", "private")}
    for p in out.values():
        p.mkdir()
    (out["private"] / "keyring.json").write_text(KEYRING)
    return out

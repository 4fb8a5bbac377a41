"""The README stays true: its configuration table matches the schema, and the set-up it
promises is what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

from spotagent.config import SCHEMA, _show

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def table_rows() -> dict[str, str]:
    rows = {}
    for m in re.finditer(r"^\| `([a-z_]+\.[a-z_]+)` \| `([^`]*)` \|", README, re.M):
        rows[m.group(1)] = m.group(2)
    return rows


def test_every_setting_is_documented_with_its_default() -> None:
    rows = table_rows()
    for section, keys in SCHEMA.items():
        for key, spec in keys.items():
            name = f"{section}.{key}"
            assert name in rows, f"{name} missing from the README's configuration table"
            want = "(required)" if spec.required else _show(spec.default)
            assert rows[name] == want, f"{name}: README says {rows[name]}, code says {want}"


def test_no_documented_setting_is_unknown() -> None:
    known = {f"{s}.{k}" for s, keys in SCHEMA.items() for k in keys}
    assert set(table_rows()) <= known


def test_setup_is_two_commands_and_ci_runs_the_test_one() -> None:
    assert "make demo" in README and "make test" in README
    ci = (REPO / ".ci/run").read_text()
    assert "make test" in ci

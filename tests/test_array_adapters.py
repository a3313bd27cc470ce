"""The array adapters: each has the protocol's members, and beside them only optional hooks fastembed asks for."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import fastembed
from fastembed.arrays import ADAPTERS, OPTIONAL_HOOKS, ArrayAdapter

PROTOCOL = {name for name in dir(ArrayAdapter) if not name.startswith("_")} | set(ArrayAdapter.__annotations__)
#: getattr on an adapter by a literal name: ``getattr(adapter, "x"``, ``getattr(adapter_of(...), "x"``,
#: ``getattr(library, "x"`` (validation's name for a table's adapter).
ASKED_FOR = re.compile(r'getattr\((?:adapter|library|adapter_of\([^)]*\)), "(\w+)"')


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda adapter: adapter.name)
def test_an_adapter_defines_the_protocol_and_known_hooks_only(adapter):
    names = {name for name in dir(adapter) if not name.startswith("_")}
    assert PROTOCOL <= names, f"{adapter.name} lacks {sorted(PROTOCOL - names)}"
    assert names - PROTOCOL <= set(OPTIONAL_HOOKS), f"{adapter.name}: unknown hooks {sorted(names - PROTOCOL - set(OPTIONAL_HOOKS))}"


def test_every_hook_asked_for_is_listed_and_every_listed_hook_is_asked_for():
    package = Path(fastembed.__file__).parent
    asked = {name for path in package.rglob("*.py") for name in ASKED_FOR.findall(path.read_text())}
    assert asked - PROTOCOL == set(OPTIONAL_HOOKS), (asked - PROTOCOL) ^ set(OPTIONAL_HOOKS)

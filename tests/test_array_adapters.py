"""The array adapters: each has the protocol's members, and beside them only optional hooks fastembed asks for."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fastembed
from fastembed.arrays import ADAPTERS, OPTIONAL_HOOKS, ArrayAdapter

PROTOCOL = {name for name in dir(ArrayAdapter) if not name.startswith("_")} | set(ArrayAdapter.__annotations__)


def names_asked_of_adapters(source: str) -> set[str]:
    """The literal names ``getattr``/``hasattr`` ask of an adapter in `source`: calls whose object is an adapter
    (a name or expression that says adapter, or ``library``, validation's name for a table's adapter)."""
    asked = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            subject = ast.unparse(node.args[0])
            if "adapter" in subject.lower() or subject == "library":
                asked.add(node.args[1].value)
    return asked


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda adapter: adapter.name)
def test_an_adapter_defines_the_protocol_and_known_hooks_only(adapter):
    names = {name for name in dir(adapter) if not name.startswith("_")}
    assert PROTOCOL <= names, f"{adapter.name} lacks {sorted(PROTOCOL - names)}"
    assert names - PROTOCOL <= set(OPTIONAL_HOOKS), f"{adapter.name}: unknown hooks {sorted(names - PROTOCOL - set(OPTIONAL_HOOKS))}"


def test_every_hook_asked_for_is_listed_and_every_listed_hook_is_asked_for():
    package = Path(fastembed.__file__).parent
    asked = {name for path in package.rglob("*.py") for name in names_asked_of_adapters(path.read_text())}
    assert asked - PROTOCOL == set(OPTIONAL_HOOKS), (asked - PROTOCOL) ^ set(OPTIONAL_HOOKS)

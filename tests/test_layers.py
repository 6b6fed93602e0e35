"""The package tree is the architecture: each layer imports only the layers below it.

    cli  >  tools  >  router, vllm  >  net  >  core

`router` and `vllm` are siblings and never import each other. `kvtier/__init__.py` re-exports
the core. Lazy imports inside functions count too. The core and the connector's settings also
stay free of the heavy third-party stacks of the layers above (checked on the import graph, so
a new module cannot slip one in).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS: dict[str, int] = {"core": 0, "net": 1, "router": 2, "vllm": 2, "tools": 3, "cli": 4}
SIBLINGS_APART = {("router", "vllm"), ("vllm", "router")}
CORE_FORBIDDEN = (
    "vllm",
    "torch",
    "aiohttp",
    "uvicorn",
    "httptools",
    "httpx",
    "transformers",
    "matplotlib",
    "prometheus_client",
    "tqdm",
    "yaml",
)
"""Third-party packages the core must not import (the connector's image carries only core)."""


def layer_of(module: str) -> str:
    """`kvtier.core.store` -> "core"; `kvtier` itself re-exports the core."""
    parts = module.split(".")
    if len(parts) == 1:
        return "core"
    return parts[1] if parts[1] in LAYERS else "cli"


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """Every name `path` imports (`a.b` for `import a.b`, `a.b.c` for `from a.b import c`),
    top level and inside functions, with its line."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str]] = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def modules(src: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def violations(src: Path) -> list[str]:
    """Upward or sideways imports between kvtier's layers, and heavy stacks in the core."""
    found = []
    known = modules(src)
    for module, path in known.items():
        if not module.startswith("kvtier"):
            continue
        mine = layer_of(module)
        for line, name in imports_of(path, module):
            where = f"{path.relative_to(src)}:{line}"
            top = name.split(".")[0]
            if mine == "core" and top in CORE_FORBIDDEN:
                found.append(f"{where}: the core imports {name.rpartition('.')[0] or name}")
            target = name if name in known else name.rpartition(".")[0]
            if top != "kvtier" or target not in known:
                continue
            theirs = layer_of(target)
            if LAYERS[theirs] > LAYERS[mine] or (mine, theirs) in SIBLINGS_APART:
                found.append(f"{where}: {mine} imports {target} ({theirs})")
    return found


def test_no_module_imports_a_layer_above_its_own() -> None:
    assert violations(SRC) == []


def test_the_check_catches_a_planted_upward_import(tmp_path: Path) -> None:
    pkg = tmp_path / "kvtier"
    for sub in ("core", "router", "vllm"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "router" / "app.py").write_text("VALUE = 1\n")
    (pkg / "core" / "store.py").write_text(
        "def late():\n    from kvtier.router.app import VALUE\n    import torch\n"
    )
    (pkg / "vllm" / "connector.py").write_text("from kvtier.router import app\n")
    assert violations(tmp_path) == [
        "kvtier/core/store.py:2: core imports kvtier.router.app (router)",
        "kvtier/core/store.py:3: the core imports torch",
        "kvtier/vllm/connector.py:1: vllm imports kvtier.router.app (router)",
    ]


@pytest.mark.parametrize("module", ["kvtier.core.store", "kvtier.router.app"])
def test_layer_names_follow_the_package(module: str) -> None:
    assert layer_of(module) == module.split(".")[1]

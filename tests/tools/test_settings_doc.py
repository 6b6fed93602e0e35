"""docs/settings.md is exactly what the settings classes render (regenerate it with
`python -m kvtier.tools.settings_doc > docs/settings.md` after changing a setting)."""

from __future__ import annotations

import re
from pathlib import Path

from kvtier.core.settings import StoreSettings
from kvtier.router.settings import RouterSettings
from kvtier.tools.deploy.settings import KubernetesSpec, Resources
from kvtier.tools.settings_doc import render

DOCS = Path(__file__).resolve().parents[2] / "docs"
DOC = DOCS / "settings.md"


def test_the_settings_doc_is_in_sync_with_the_code() -> None:
    assert DOC.read_text() == render()


def test_every_store_and_router_setting_is_documented_with_its_meaning() -> None:
    text = render()
    for cls in (StoreSettings, RouterSettings):
        for name, field in cls.model_fields.items():
            assert f"| `{name}` |" in text
            assert field.description, f"{cls.__name__}.{name} has no docstring"


def test_every_kubernetes_key_is_documented_with_its_meaning() -> None:
    text = render()
    for cls in (KubernetesSpec, Resources):
        for name, field in cls.model_fields.items():
            assert f"| `{field.alias or name}` |" in text
            assert field.description, f"{cls.__name__}.{name} has no docstring"


def test_the_docs_point_only_to_tables_the_settings_doc_has() -> None:
    text = render()
    for page in DOCS.glob("*.md"):
        for name in re.findall(r"`docs/settings\.md` \(`(\w+)`\)", page.read_text()):
            assert f"(`{name}`)" in text, f"{page.name} points to a {name} table"

"""docs/config.md is generated from the config classes and must not drift from them."""

import dataclasses
from pathlib import Path

from rl_launcher import config as config_module
from rl_launcher.config.docs import render

DOCS = Path(__file__).resolve().parents[3] / "docs" / "config.md"


def test_checked_in_docs_match_the_classes():
    assert DOCS.is_file(), (
        f"{DOCS} is missing; run: python -m rl_launcher.config.docs > docs/config.md"
    )
    assert DOCS.read_text() == render(), (
        "docs/config.md is out of date; regenerate it: python -m rl_launcher.config.docs > docs/config.md"
    )


def test_every_option_is_documented_and_listed():
    text = render()
    classes = [c for c in vars(config_module).values() if dataclasses.is_dataclass(c)]
    assert len(classes) == 13
    for cls in classes:
        for spec in dataclasses.fields(cls):
            assert spec.metadata.get("help"), f"{cls.__name__}.{spec.name} has no help text"
            listed = f"{spec.name}` |" in text or f"## `{spec.name}`" in text
            assert listed, f"{cls.__name__}.{spec.name} missing from the docs"

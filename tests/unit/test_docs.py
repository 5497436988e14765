"""docs/config_reference.md is generated from the config dataclasses and must be regenerated when they change."""

from scripts import generate_config_reference
from torchtitan.config.options import option_specs


def test_config_reference_is_up_to_date():
    committed = generate_config_reference.OUTPUT.read_text()
    assert committed == generate_config_reference.render(), (
        "docs/config_reference.md is out of date: run python scripts/generate_config_reference.py")


def test_config_reference_lists_every_option_under_its_section():
    text = generate_config_reference.render()
    for key, spec in option_specs().items():
        section, option = key.rsplit(".", 1)
        table = text.split(f"## [{section}]\n", 1)[1].split("\n## ", 1)[0]
        assert f"| `{option}` |" in table, f"{key} is missing from the [{section}] table"

"""The config-file check shared by the config-driven commands (`cli.config_problem`): the fields a file must have, and
the values ml_collections would take for them as overrides."""

from __future__ import annotations

from ml_collections import config_dict

from granite_jax import cli


def schema() -> config_dict.ConfigDict:
    return config_dict.ConfigDict(
        dict(
            name="x",
            rate=config_dict.placeholder(float),
            lengths=config_dict.placeholder(tuple),
            section=dict(on=True, count=1),
        )
    )


def config(**fields) -> config_dict.ConfigDict:
    """A config file's result, built field by field as a file may (so that no type is checked on the way)."""
    return config_dict.ConfigDict(dict(name="y", rate=0.5, lengths=(1,), section=dict(on=False, count=2)) | fields)


def test_config_problem_takes_what_an_override_may_set():
    for fields in (
        dict(rate=1),
        dict(rate=None),
        dict(lengths=[1, 2]),
        dict(name=None),
        dict(section=dict(on=True, count=0)),
    ):
        assert cli.config_problem(config(**fields), schema()) is None, fields


def test_config_problem_names_the_first_bad_field_and_what_fits():
    cases = [
        (dict(rate="fast"), "config.rate must be a number, got 'fast' (str)"),
        (dict(section=dict(on=1, count=0)), "config.section.on must be a boolean, got 1 (int)"),
        (dict(section=3), "config.section must be a section of fields (count, on), got 3"),
        (dict(name=dict(first="a")), "config.name must be a string, got a section"),
        (dict(section=dict(on=True)), "missing field 'count' in config.section (expected fields: count, on)"),
        (dict(extra=1), "unknown field 'extra' in config (fields: lengths, name, rate, section)"),
    ]
    for fields, message in cases:
        assert cli.config_problem(config(**fields), schema()) == message

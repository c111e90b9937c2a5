"""Every `ds-omni` command's --help says what it does in one line and shows how it is called: a
newcomer's first hour starts at `ds-omni --help`."""

from __future__ import annotations

import argparse

import pytest

from ds_omni import cli


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) of the top level and of every sub-command, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, path + (name,))


COMMANDS = dict(_commands(cli._parser()))


def test_every_command_is_listed():
    assert {" ".join(p) for p in COMMANDS} >= {
        "", "train", "supervise", "convert", "plan", "calibrate-cost", "families", "data",
        "data make-demo", "data eval-demo", "data check"}


@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda p: " ".join(p) or "ds-omni")
def test_help_has_a_one_line_description_and_an_example(path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*path, "--help"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    command = " ".join(("ds-omni",) + path)
    description = COMMANDS[path].description or ""
    assert description and "\n" not in description and description in lines, \
        f"`{command} --help` needs a one-line description (argparse description=)"
    heading = next((i for i, line in enumerate(lines) if line in ("example:", "examples:")), None)
    assert heading is not None, f"`{command} --help` needs an 'example:' section (epilog=)"
    examples = [line.strip() for line in lines[heading + 1:] if line.startswith("  ")]
    assert any(e.startswith(command + " ") for e in examples), \
        f"`{command} --help` shows no example line starting with '{command} '"


def test_every_sub_command_is_listed_with_its_description():
    for path, parser in COMMANDS.items():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {a.dest: a.help for a in action._choices_actions}
                assert helps == {n: sub.description for n, sub in action.choices.items()}, path

"""`python -m ragtrain COMMAND ARGS...` runs ragtrain/commands/COMMAND.py's `main(ARGS)`; anything else is one run's
Hydra command line, whose --help names the commands. (The commands run as users run them, in a new interpreter:
tests/commands/test_search.py, test_ask.py, test_compare.py.)"""

from __future__ import annotations

import importlib

import pytest
from hydra import compose, initialize_config_dir

from ragtrain.__main__ import COMMANDS, run_command
from tests.conftest import CONF_DIR, REPO


def test_every_command_is_a_module_of_the_commands_package() -> None:
    modules = {p.stem for p in (REPO / "ragtrain" / "commands").glob("*.py")} - {"__init__"}
    assert set(COMMANDS) <= modules
    assert all(callable(importlib.import_module(f"ragtrain.commands.{c}").main) for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_commands_usage_names_its_invocation(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as stop:  # argparse's --help
        run_command([command, "--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m ragtrain {command} ")


def test_a_commands_bad_input_is_its_exit_status(tmp_path, capsys) -> None:
    assert run_command(["search", str(tmp_path), "who founded it?"]) == 2
    assert capsys.readouterr().err.startswith("search error: ")


@pytest.mark.parametrize("argv", [[], ["experiment=quickstart"], ["--help"], ["search=1"], ["-m", "search"]])
def test_anything_else_is_left_to_hydra(argv: list[str]) -> None:
    assert run_command(argv) is None


def test_the_help_header_names_every_command() -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        header = compose(config_name="config", return_hydra_config=True).hydra.help.header
    assert "python -m ragtrain experiment=NAME" in header
    assert ", ".join(COMMANDS) in header

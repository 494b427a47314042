"""Running the command line in-process (``main`` with arguments, output captured) and its commands."""

import click
import pytest

from adaptive.cli.main import cli, main


def run(capsys, *args):
    """``adaptive ARGS`` expected to exit: ``(exit code, stdout, stderr)``."""
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def run_ok(capsys, *args):
    """``adaptive ARGS`` expected to succeed: ``(stdout, stderr)``."""
    try:
        main(list(args))
    except SystemExit as exc:
        assert exc.code in (0, None), capsys.readouterr().err
    out = capsys.readouterr()
    return out.out, out.err


def commands() -> dict[str, click.Command]:
    """Every command by its full name (``"profile show"`` for a group's subcommand)."""
    out = {}
    for name, cmd in cli.commands.items():
        if isinstance(cmd, click.Group):
            out.update({f"{name} {sub}": c for sub, c in cmd.commands.items()})
        else:
            out[name] = cmd
    return out

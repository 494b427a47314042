"""``adaptive``: a thin click layer over the library. User errors are one line and exit code 1."""

from __future__ import annotations

import sys
import warnings

import click

from adaptive.cli.bench import bench_cmd
from adaptive.cli.calibrate import calibrate_cmd, profile_group, route_cmd
from adaptive.cli.demo import demo_cmd
from adaptive.cli.distill import distill_cmd
from adaptive.cli.generate import decode_cmd, generate_cmd
from adaptive.cli.serve import serve_cmd
from adaptive.errors import AdaptiveError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="adaptive")
def cli() -> None:
    """Adaptive, domain-aware self-speculative decoding.

    \b
    adaptive demo                                  calibrate (quick), route a prompt, print the speedup
    adaptive decode PROMPT --drafter ssd ...       decode with a drafter you choose (no profile)
    adaptive calibrate --domains NAME=PATH ...     find the best drafter per domain: a profile
    adaptive generate PROMPT --profile DIR         decode through a profile (routed)
    adaptive serve --profile DIR                   the same over OpenAI's HTTP API
    """


for command in (demo_cmd, decode_cmd, calibrate_cmd, generate_cmd, route_cmd, profile_group, bench_cmd, distill_cmd,
                serve_cmd):
    cli.add_command(command)


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning on the command line: one line, ``Warning: ...``, as errors are ``Error: ...``."""
    click.echo(f"Warning: {message}", err=True)


def main(argv: list[str] | None = None) -> None:
    warnings.showwarning = _one_line_warning
    try:
        cli.main(args=argv, prog_name="adaptive", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.UsageError as exc:  # one line: the problem, and where the options are described
        ctx = exc.ctx
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        click.echo(f"Error: {exc.format_message()}{hint}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except AdaptiveError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()

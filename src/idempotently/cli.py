"""The `idempotently` command: a thin layer over Journal and Session."""

from __future__ import annotations

import click

from idempotently import __version__


@click.group()
@click.version_option(__version__, prog_name="idempotently")
def cli() -> None:
    """Audit and resume the idempotently journal."""


def _register_mock_server() -> None:
    # The command module imports starlette/uvicorn only when it runs, so the
    # CLI works without the [mock] extra and says what to install.
    from idempotently.testing.cli import mock_server_command

    cli.add_command(mock_server_command)


_register_mock_server()

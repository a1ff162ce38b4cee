"""`idempotently mock-server`: the companion mock server on a loopback port.

This module is imported by the main CLI on every run, so it must not import
starlette or uvicorn (the optional `[mock]` extra) until the command runs.
"""

from __future__ import annotations

import click

from idempotently._cli_durations import SECONDS
from idempotently.testing._config import DEFAULT_KEY_TTL, DEFAULT_STALE_AFTER

MOCK_EXTRA_MESSAGE = "the mock server needs the [mock] extra: pip install 'idempotently[mock]'"


@click.command("mock-server")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8000,
    show_default=True,
    help="Port; 0 picks a free one.",
)
@click.option(
    "--provider-latency",
    type=SECONDS,
    default=0.0,
    show_default=True,
    metavar="SECONDS",
    help="How long each call to the fake provider takes.",
)
@click.option(
    "--stale-after",
    type=SECONDS,
    default=DEFAULT_STALE_AFTER,
    show_default=True,
    metavar="SECONDS",
    help="Age after which an in_progress key may be taken over.",
)
@click.option(
    "--key-ttl",
    type=SECONDS,
    default=DEFAULT_KEY_TTL,
    show_default=True,
    metavar="SECONDS",
    help="How long a key is remembered.",
)
@click.option(
    "--in-progress",
    type=click.Choice(["409", "423", "wait"]),
    default="409",
    show_default=True,
    help="Answer to a key in progress: 409, 423 + Retry-After, or wait and replay.",
)
@click.option(
    "--mismatch",
    type=click.Choice(["422", "stripe"]),
    default="422",
    show_default=True,
    help="Answer to a key reused with another payload: 422, or Stripe's 400 idempotency_error.",
)
@click.option(
    "--store-server-errors/--no-store-server-errors",
    default=True,
    show_default=True,
    help="Replay a 500 that followed the side effect, or let a retry run again.",
)
@click.option(
    "--key-format",
    type=click.Choice(["bare", "quoted"]),
    default="bare",
    show_default=True,
    help="Idempotency-Key taken verbatim, or as an RFC 8941 quoted string.",
)
@click.option(
    "--db",
    default=":memory:",
    show_default=True,
    metavar="PATH",
    help="SQLite file for keys, charges and the ledger.",
)
@click.option(
    "--virtual-clock",
    is_flag=True,
    help='Keep time still until POST /v1/_clock {"advance": SECONDS} moves it.',
)
@click.option(
    "--log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    default="info",
    show_default=True,
)
def mock_server_command(
    host: str,
    port: int,
    provider_latency: float,
    stale_after: float,
    key_ttl: float,
    in_progress: str,
    mismatch: str,
    store_server_errors: bool,
    key_format: str,
    db: str,
    virtual_clock: bool,
    log_level: str,
) -> None:
    """Run the companion mock payments server on loopback.

    It serves POST/GET /v1/charges. Prints the server's URL on the first line
    of stdout; Ctrl-C stops it (exit 0). Faults, the clock and the ledger are
    driven over HTTP:

    \b
      POST/GET/DELETE /v1/_faults   schedule, list, clear faults
      GET/POST /v1/_clock           read or advance the virtual clock
      GET /v1/_stats, /v1/_ledger, /v1/_keys; POST /v1/_sweep

    \b
    The Python API, with every fault and switch:
      python -m pydoc idempotently.testing
    """
    try:
        from idempotently.testing._app import MockApp
        from idempotently.testing._server import run
    except ImportError as error:
        if (error.name or "").partition(".")[0] in ("starlette", "uvicorn"):
            raise click.ClickException(MOCK_EXTRA_MESSAGE) from None
        raise

    from idempotently.testing._clock import SystemClock, VirtualClock
    from idempotently.testing._config import MockServerConfig

    try:
        config = MockServerConfig(
            stale_after=stale_after,
            key_ttl=key_ttl,
            provider_latency=provider_latency,
            in_progress=in_progress,  # type: ignore[arg-type]  # click.Choice checked it
            mismatch=mismatch,  # type: ignore[arg-type]
            store_server_errors=store_server_errors,
            key_format=key_format,  # type: ignore[arg-type]
        )
    except ValueError as error:
        raise click.BadParameter(str(error)) from None

    def announce(url: str) -> None:
        click.echo(url)
        click.echo(f"idempotently mock server listening on {url} (Ctrl-C to stop)", err=True)

    app = MockApp(config, clock=VirtualClock() if virtual_clock else SystemClock(), db=db)
    try:
        run(app, host=host, port=port, log_level=log_level, on_ready=announce)
    except OSError as error:
        raise click.ClickException(f"cannot listen on {host}:{port}: {error}") from None
    except KeyboardInterrupt:
        # Ctrl-C is how this command is meant to stop: the server has shut down
        # cleanly, so it is a success, not click's "Aborted!" and exit 1.
        return

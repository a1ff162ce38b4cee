"""How the mock server is shipped: exports, the optional extra, the CLI, the docs' example."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import attrs
import httpx
import pytest

import idempotently
import idempotently.testing
from idempotently.testing import MockServerConfig
from idempotently.testing._faults import FAULT_KINDS
from idempotently.testing.pytest_plugin import MockServerFactory

from .conftest import charge

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
# Children import the package from this checkout, installed or not.
ENV = {**os.environ, "PYTHONPATH": str(Path(idempotently.__file__).resolve().parents[1])}


def run_python(code: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
        check=False,
    )


def test_all_is_sorted_and_importable() -> None:
    """__all__ is sorted (constants, classes, functions) and every name in it resolves."""
    exported = idempotently.testing.__all__

    assert sorted(exported, key=lambda n: (not n.isupper(), not n[0].isupper(), n)) == exported
    assert all(getattr(idempotently.testing, name) is not None for name in exported)


def test_cli_and_plugin_load_without_the_mock_extra() -> None:
    """Without starlette/uvicorn the CLI and plugin import, and the command names the extra."""
    result = run_python(
        """
        import sys
        sys.modules["starlette"] = sys.modules["uvicorn"] = None  # as if not installed
        import idempotently.testing.cli, idempotently.testing.pytest_plugin
        from click.testing import CliRunner
        from idempotently.testing.cli import mock_server_command
        outcome = CliRunner().invoke(mock_server_command, ["--port", "0"])
        print(outcome.exit_code, outcome.output)
        try:
            from idempotently.testing import serve
        except ImportError as error:
            print(error)
        """
    )

    assert 0 == result.returncode, result.stderr
    assert result.stdout.startswith("1 ")
    assert 2 == result.stdout.count("pip install 'idempotently[mock]'")


def test_mock_server_command_serves_on_a_free_port() -> None:
    """`mock-server --port 0` prints its URL first, serves charges, and stops on SIGTERM."""
    command = [
        sys.executable,
        "-c",
        "from idempotently.testing.cli import mock_server_command; mock_server_command()",
        "--port",
        "0",
        "--virtual-clock",
        "--in-progress",
        "423",
        "--log-level",
        "warning",
    ]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=ENV) as process:
        try:
            assert process.stdout is not None
            url = process.stdout.readline().strip()
            headers = {"Authorization": "Bearer u", "Idempotency-Key": "k-1"}
            created = httpx.post(f"{url}/v1/charges", json=charge(), headers=headers)
            moved = httpx.post(f"{url}/v1/_clock", json={"advance": 60})
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=10)

    assert url.startswith("http://127.0.0.1:")
    assert 201 == created.status_code
    assert 200 == moved.status_code


def test_the_documented_example_runs() -> None:
    """examples/mock_server_example.py (shown in docs/mock-server.md) exits 0."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "mock_server_example.py")],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
        check=False,
    )

    assert 0 == result.returncode, result.stderr
    assert "1 charge for order-42" in result.stdout


def test_docs_name_every_fault_and_switch() -> None:
    """docs/mock-server.md documents every fault kind and every config switch."""
    page = (ROOT / "docs" / "mock-server.md").read_text()
    faults = [f"`Fault.{kind}(" for kind in FAULT_KINDS]
    switches = [f"`{name}`" for name in attrs.fields_dict(MockServerConfig)]

    assert [] == [name for name in faults + switches if name not in page]


def test_server_survives_a_client_killed_mid_request(
    idempotently_mock_server_factory: MockServerFactory,
) -> None:
    """A client SIGKILLed during the provider call: the server still commits the charge."""
    server = idempotently_mock_server_factory(MockServerConfig(provider_latency=0.5))
    client = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import httpx, sys; httpx.post(sys.argv[1] + '/v1/charges', json={'amount': 1, "
            "'currency': 'usd', 'customer': 'c'}, headers={'Authorization': 'Bearer u', "
            "'Idempotency-Key': 'k-1'}, timeout=10)",
            server.url,
        ],
        env=ENV,
    )
    deadline = time.monotonic() + 10
    while not server.idempotency_keys() and time.monotonic() < deadline:
        time.sleep(0.01)
    client.kill()
    client.wait()
    while server.idempotency_keys()[0].status == "in_progress" and time.monotonic() < deadline:
        time.sleep(0.01)

    assert ["completed"] == [record.status for record in server.idempotency_keys()]
    assert {("u", "k-1"): 1} == server.charge_count_by_key()
    with server.client(token="u") as survivor:
        assert 200 == survivor.get("/v1/charges").status_code


def test_mock_server_stops_on_ctrl_c_with_exit_0_and_no_abort_message() -> None:
    """Ctrl-C (SIGINT) is the documented way to stop `mock-server`: exit 0, no "Aborted!"."""
    command = [
        sys.executable,
        "-c",
        "from idempotently.testing.cli import mock_server_command; mock_server_command()",
        "--port",
        "0",
        "--log-level",
        "warning",
    ]
    # A child started from a shell in the background may inherit SIGINT ignored;
    # a terminal's Ctrl-C reaches a process whose SIGINT has its default handler.
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ) as process:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        assert 401 == httpx.get(f"{url}/v1/charges").status_code  # it is serving
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=20)

    assert 0 == process.returncode, stderr
    assert "Aborted" not in stderr
    assert "Traceback" not in stderr


MOCK_FIXTURE_TEST = """
import sys

sys.modules["starlette"] = sys.modules["uvicorn"] = None  # as if the extra were missing


def test_uses_the_fixture(idempotently_session):
    pass
"""


def test_the_session_fixture_without_the_mock_extra_names_the_extra(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`idempotently_session` without starlette/uvicorn fails with the pip command, no traceback."""
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    pytester.makepyfile(MOCK_FIXTURE_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly")

    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["*need the [[]mock[]] extra*pip install 'idempotently[[]mock[]]'*"]
    )
    assert "ModuleNotFoundError" not in result.stdout.str()

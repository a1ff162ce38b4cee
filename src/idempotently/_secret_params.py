"""Secret query parameters: journaled redacted, re-applied before a resend (pure).

``POST /v1/charges?api_key=sk_live_...`` is journaled as
``/v1/charges?api_key=[redacted]`` and the operation's ``secret_params`` name
``api_key``; before the request is sent again, each redacted value is put back
from a live source (the caller's own request, the session's client ``params``,
or the command line's ``--param-env``), byte for byte where the source has
the raw bytes, in the place it had. A resend without a value for one of them
sends nothing.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import httpx

from idempotently._keys import journaled_response_headers, journaled_url

DEFAULT_SECRET_PARAMS = frozenset(
    {
        "access_token",
        "api-key",
        "api_key",
        "apikey",
        "auth",
        "client_secret",
        "passwd",
        "password",
        "refresh_token",
        "secret",
        "sig",
        "signature",
        "token",
        "x-amz-security-token",
        "x-amz-signature",
        "x-goog-signature",
    }
)
"""Query parameters journaled redacted whatever the journal is told (compared without
case). ``key`` is not among them: too many APIs use it for a resource's own key, and a
redacted value the resend cannot find keeps the operation from being sent; add it with
``Journal(redact_query=["key"])`` for an API that takes its API key as ``?key=``."""

REDACTED = "[redacted]"
"""What a redacted value is journaled as (and how messages show it)."""

LiveValues = Callable[[str], Sequence[str] | None]
"""A parameter's live values, as they go in a query (percent-encoded), or None."""


def secret_param_names(extra: Iterable[str] = ()) -> frozenset[str]:
    """The default secret parameters and ``extra``, lowercased."""
    return DEFAULT_SECRET_PARAMS | {name.lower() for name in extra}


def check_param_names(names: object, argument: str = "redact_query") -> tuple[str, ...]:
    """A list of query parameter names, or a TypeError/ValueError naming ``argument``."""
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise TypeError(
            f"{argument} must be a list of query parameter names (e.g. ['session_key']), "
            f"not {type(names).__name__}"
        )
    checked = []
    for name in names:
        if not isinstance(name, str) or not name or not name.isprintable():
            raise ValueError(
                f"{argument} must hold query parameter names (non-empty printable str), "
                f"not {name!r:.60}"
            )
        checked.append(name)
    return tuple(checked)


QUERY_NAME = re.compile(r"[^\s=&#]+")
"""A query parameter's name as one can be given apart from a URL: printable, no space,
``=``, ``&`` or ``#``."""


def param_name_problem(name: str) -> str | None:
    """What makes ``name`` no query parameter name, without quoting it; None if it is one."""
    if not QUERY_NAME.fullmatch(name) or not name.isprintable():
        return "is not a query parameter name (printable, no space, '=', '&' or '#')"
    return None


def param_value_problem(value: str) -> str | None:
    """What makes ``value`` unusable as a redacted parameter's value, without quoting it
    (it is a credential); None if it is usable."""
    if not value or value != value.strip() or not value.isprintable():
        return (
            "is empty, starts or ends with whitespace, or holds a control character (check "
            "for a stray newline)"
        )
    return None


def check_redacted_params(values: object, argument: str = "redacted_params") -> dict[str, str]:
    """Values of redacted query parameters given by name (``{"api_key": "sk_..."}``), or
    a TypeError/ValueError naming ``argument`` in one line that never quotes a value,
    nor a name that is none (it may be a credential given in the wrong place)."""
    if not isinstance(values, Mapping):
        raise TypeError(
            f"{argument} must be a mapping of query parameter names to values (e.g. "
            f"{{'api_key': os.environ['API_KEY']}}), not {type(values).__name__}"
        )
    checked: dict[str, str] = {}
    for name, value in values.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(
                f"{argument} must map str names to str values, not {type(name).__name__} "
                f"to {type(value).__name__}"
            )
        problem = param_name_problem(name)
        if problem is not None:
            raise ValueError(f"{argument}: a name {problem}; it is not repeated here")
        problem = param_value_problem(value)
        if problem is not None:
            raise ValueError(f"{argument}: the value for {name!r} {problem}")
        checked[name] = value
    return checked


def _name_of(raw_pair: str) -> str:
    return urllib.parse.unquote_plus(raw_pair.partition("=")[0])


def redacted_url(url: httpx.URL, secret: frozenset[str]) -> tuple[str, tuple[str, ...]]:
    """The URL as journaled (no userinfo, the values of ``secret`` parameters
    `REDACTED`) and the names redacted, each once, as the URL spells them."""
    if not url.query:
        return journaled_url(url), ()
    raw_query = url.query.decode("ascii")
    pairs = raw_query.split("&")
    names: list[str] = []
    for index, pair in enumerate(pairs):
        raw_name, sep, _ = pair.partition("=")
        if not sep:
            continue
        name = urllib.parse.unquote_plus(raw_name)
        if name.lower() in secret:
            pairs[index] = f"{raw_name}={REDACTED}"
            if name not in names:
                names.append(name)
    if not names:
        return journaled_url(url), ()
    query = "&".join(pairs).encode("ascii")
    return journaled_url(url.copy_with(query=query)), tuple(names)


_URL_HEADERS = frozenset({"location", "content-location"})
"""Answer headers whose value is a URL: a server may echo the request's secrets there."""


def journaled_answer_headers(
    headers: httpx.Headers, redacted: frozenset[str], secret: frozenset[str]
) -> list[tuple[str, str]]:
    """An answer's headers as journaled (`journaled_response_headers`), a URL one of them
    carries (a 303's Location echoing ``?api_key=...``) journaled as a request URL is:
    without its userinfo, the values of ``secret`` parameters redacted."""
    stored = journaled_response_headers(headers, redacted)
    if not any(name.lower() in _URL_HEADERS for name, _ in stored):
        return stored
    return [
        (name, _journaled_location(value, secret) if name.lower() in _URL_HEADERS else value)
        for name, value in stored
    ]


def _journaled_location(value: str, secret: frozenset[str]) -> str:
    try:
        url = httpx.URL(value)
        journaled, names = redacted_url(url, secret)
    except (httpx.InvalidURL, UnicodeError, ValueError):
        return value  # not a URL httpx reads: nothing in it is a parameter or userinfo
    return journaled if names or url.userinfo else value


class MissingParams(ValueError):
    """Values of redacted parameters that no live source has: nothing may be sent."""

    def __init__(self, names: Sequence[str]) -> None:
        super().__init__(", ".join(names))
        self.names = tuple(names)


def reapplied_url(url: httpx.URL, names: Sequence[str], values: LiveValues) -> httpx.URL:
    """``url`` with each redacted parameter in ``names`` given its live value again, in
    its place (the i-th occurrence its i-th value, the last value for any more).

    Raises `MissingParams` naming every parameter without a live value."""
    if not names:
        return url
    wanted = set(names)
    live = {name: values(name) for name in names}
    missing = [name for name in names if not live[name]]
    if missing:
        raise MissingParams(missing)
    raw_query = url.query.decode("ascii")
    pairs = raw_query.split("&") if raw_query else []
    seen: dict[str, int] = {}
    for index, pair in enumerate(pairs):
        raw_name, sep, _ = pair.partition("=")
        name = urllib.parse.unquote_plus(raw_name)
        if not sep or name not in wanted:
            continue
        found = live[name] or ()
        count = seen.get(name, 0)
        seen[name] = count + 1
        pairs[index] = f"{raw_name}={found[min(count, len(found) - 1)]}"
    return url.copy_with(query="&".join(pairs).encode("ascii"))


def values_in_url(url: httpx.URL) -> LiveValues:
    """The raw values a live request's URL carries, by parameter name."""
    found: dict[str, list[str]] = {}
    if url.query:
        for pair in url.query.decode("ascii").split("&"):
            raw_name, sep, raw_value = pair.partition("=")
            if sep:
                found.setdefault(urllib.parse.unquote_plus(raw_name), []).append(raw_value)
    return found.get


def values_in_params(*sources: Any) -> LiveValues:
    """Parameters given as values (a client's ``params``, an httpx or httpx2
    ``QueryParams``; ``--param-env``, a dict), encoded the way httpx encodes them into
    a URL; the first source that has a name wins."""

    def values(name: str) -> list[str] | None:
        for source in sources:
            given = (
                list(source.get_list(name))
                if hasattr(source, "get_list")
                else ([source[name]] if name in source else [])
            )
            if given:
                return [
                    str(httpx.QueryParams([(name, value)])).partition("=")[2] for value in given
                ]
        return None

    return values

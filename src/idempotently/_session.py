"""Session and AsyncSession: httpx clients whose writes run through the operation flow.

They render the request, check the caller's arguments, and hand both to the
flow (``_flow/``) through a driver (``_drivers.py``); every decision is the
flow's.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio
import attrs
import httpx

from idempotently import _httpx2, _redirects

if TYPE_CHECKING:  # httpx's private modules, and httpx2 (optional), for annotations only
    import httpx2
    from httpx._client import UseClientDefault
    from httpx._types import (
        CookieTypes,
        HeaderTypes,
        QueryParamTypes,
        RequestContent,
        RequestData,
        RequestExtensions,
        RequestFiles,
        TimeoutTypes,
    )

    from idempotently._group import AsyncGroup, Group
    from idempotently._lookup import Verdict
    from idempotently._watch import WatchBatch, WatchSummary

from idempotently._answers import DEFAULT_MAX_RESPONSE_BYTES
from idempotently._drivers import FlowFactory, arun, arun_each, run, run_each
from idempotently._flow._checks import check_call_arguments, check_host_id, check_timeouts
from idempotently._flow._config import DEFAULT_LEASE_DURATION, DEFAULT_WATCH_INTERVAL
from idempotently._flow._engine import Engine
from idempotently._flow._leases import default_host_id
from idempotently._flow._operation import Call, Held, ResumeResult, Settlement, profile_for
from idempotently._flow._read import retried_read
from idempotently._gate import alast_hook, keep_last, last_hook
from idempotently._hooks import AsyncHook, Hook, check_hooks
from idempotently._journal import Journal, Operation
from idempotently._keys import redaction_set
from idempotently._overrides import check_attempt_header, check_call_policy, overrides_json
from idempotently._policy import RetryPolicy
from idempotently._profiles import (
    GENERIC,
    ProfileRule,
    ServerProfile,
    carry_operation_id,
    check_key_expiry_margin,
    journaled_profile,
)
from idempotently._secret_params import check_redacted_params, values_in_params
from idempotently._vocabulary import Delivery

ClientT = TypeVar("ClientT", httpx.Client, httpx.AsyncClient)
JournalArg = str | os.PathLike[str] | Journal
Reconciler = Callable[[Operation, httpx.Client], "Settlement | Verdict | None"]
"""A reconciler: a Settlement (or a `idempotently.Lookup`'s verdict), or None."""
AsyncReconciler = Callable[[Operation, httpx.AsyncClient], Awaitable["Settlement | Verdict | None"]]
OnResult = Callable[[ResumeResult], object]


def _options_of(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls).parameters)


_CLIENT_OPTIONS = {
    httpx.Client: _options_of(httpx.Client),
    httpx.AsyncClient: _options_of(httpx.AsyncClient),
}


MAX_LEASE_DURATION = 24 * 3600.0
PROFILE_RULES: tuple[ProfileRule, ...] = ("stored", "stored_only", "checked", "forced")


def check_engine_options(
    *,
    policy: object,
    profile: object,
    redact_headers: object,
    fingerprint_headers: object,
    lease_duration: object,
    key_expiry_margin: object,
    clock: object,
    sleep: object,
    asynchronous: bool,
    max_response_bytes: object = DEFAULT_MAX_RESPONSE_BYTES,
    profile_rule: object = "stored",
) -> None:
    """The options every Session and Transport shares, checked before anything is opened."""
    if isinstance(max_response_bytes, bool) or not isinstance(max_response_bytes, int):
        raise TypeError(
            "max_response_bytes must be a number of bytes (int), not "
            f"{type(max_response_bytes).__name__}"
        )
    if max_response_bytes <= 0:
        raise ValueError(
            f"max_response_bytes must be a number of bytes above 0, not {max_response_bytes}"
        )
    if policy is not None and not isinstance(policy, RetryPolicy):
        raise TypeError(f"policy must be an idempotently.RetryPolicy, not {type(policy).__name__}")
    if not isinstance(profile, ServerProfile):
        raise TypeError(
            "profile must be an idempotently.ServerProfile (e.g. "
            f"idempotently.profiles.STRIPE), not {type(profile).__name__}"
        )
    # Every operation journals the profile it was made under: one whose matcher could
    # not be imported at resume is refused here, before anything is opened or sent.
    journaled_profile(profile)
    for name, names in (
        ("redact_headers", redact_headers),
        ("fingerprint_headers", fingerprint_headers),
    ):
        if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
            raise TypeError(f"{name} must be a list of header names, not {type(names).__name__}")
        for header in names:
            if not isinstance(header, str) or not header:
                raise TypeError(f"{name} must hold header names (non-empty str), not {header!r}")
    check_attempt_header(profile, fingerprint_headers, redact_headers)  # type: ignore[arg-type]  # checked above
    if profile_rule not in PROFILE_RULES:
        raise ValueError(
            f"profile_rule must be one of {', '.join(map(repr, PROFILE_RULES))}, not "
            f"{str(profile_rule)[:40]!r}"
        )
    if key_expiry_margin is not None:
        # "stored_only" never reads an operation with this profile: each operation's own
        # key lifetime bounds the margin there (a resume applies it per operation).
        lifetime = None if profile_rule == "stored_only" else profile.key_lifetime
        check_key_expiry_margin(key_expiry_margin, lifetime, "key_expiry_margin")
    for name, value, positive, most in (
        ("lease_duration", lease_duration, True, MAX_LEASE_DURATION),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
        if not (0 <= value <= most) or (positive and value == 0):
            raise ValueError(
                f"{name} must be a number of seconds {'above' if positive else 'from'} 0 to "
                f"{most:g}, not {value!r}"
            )
    for name, function in (("clock", clock), ("sleep", sleep)):
        if not callable(function):
            raise TypeError(f"{name} must be callable, not {type(function).__name__}")
    if not asynchronous and inspect.iscoroutinefunction(sleep):
        raise TypeError(
            "sleep must be a plain function for a sync Session or Transport (e.g. time.sleep); "
            "an async one would never wait"
        )
    if asynchronous and sleep is time.sleep:
        raise TypeError(
            "sleep must be an async function for an AsyncSession or AsyncTransport (e.g. "
            "anyio.sleep); time.sleep would block the event loop"
        )


def open_journal(journal: object) -> tuple[Journal, bool]:
    """The journal to use, and whether we opened it (and so close it)."""
    if isinstance(journal, Journal):
        return journal, False
    if isinstance(journal, (str, os.PathLike)):
        return Journal(journal), True
    raise TypeError(
        f"journal must be a path (str or os.PathLike) or an idempotently.Journal, not "
        f"{type(journal).__name__}"
    )


class _SessionBase(Generic[ClientT]):
    _client_class: type[ClientT]

    def __init__(
        self,
        journal: JournalArg,
        *,
        client: Any,
        policy: RetryPolicy | None,
        profile: ServerProfile,
        redact_headers: Iterable[str],
        fingerprint_headers: Iterable[str],
        lease_duration: float,
        host_id: str | None,
        key_expiry_margin: float | None,
        clock: Callable[[], float],
        sleep: object,
        client_options: dict[str, Any],
        hooks: Iterable[AsyncHook] = (),
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        profile_rule: ProfileRule = "stored",
        redacted_params: Mapping[str, str] | None = None,
    ) -> None:
        # Everything is checked before the journal file is created.
        unknown = sorted(set(client_options) - _CLIENT_OPTIONS[self._client_class])
        if unknown:
            raise TypeError(
                f"{type(self).__name__}() got unexpected keyword argument"
                f"{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: neither an "
                f"idempotently option nor an httpx.{self._client_class.__name__} option"
            )
        if client is not None and client_options:
            raise TypeError(
                f"pass either client= or httpx client options ({', '.join(client_options)}), "
                "not both"
            )
        # An httpx2 client (openai 3.x's library) is used as it is; requests and
        # answers are converted at the boundary (_httpx2.py).
        self._httpx2 = client is not None and _httpx2.is_httpx2(client)
        name = self._client_class.__name__
        if client is not None and not (
            isinstance(client, self._client_class)
            or (self._httpx2 and isinstance(client, getattr(_httpx2.httpx2_module(), name)))
        ):
            raise TypeError(
                f"client must be an httpx.{name} or an httpx2.{name}, not {type(client).__name__}"
            )
        redact_headers = (
            tuple(redact_headers) if not isinstance(redact_headers, str) else redact_headers
        )
        fingerprint_headers = (
            tuple(fingerprint_headers)
            if not isinstance(fingerprint_headers, str)
            else fingerprint_headers
        )
        check_engine_options(
            policy=policy,
            profile=profile,
            redact_headers=redact_headers,
            fingerprint_headers=fingerprint_headers,
            lease_duration=lease_duration,
            key_expiry_margin=key_expiry_margin,
            clock=clock,
            sleep=sleep,
            asynchronous=self._client_class is httpx.AsyncClient,
            max_response_bytes=max_response_bytes,
            profile_rule=profile_rule,
        )
        given_params = {} if redacted_params is None else check_redacted_params(redacted_params)
        host = default_host_id() if host_id is None else check_host_id(host_id)
        checked_hooks = check_hooks(hooks, asynchronous=self._client_class is httpx.AsyncClient)
        self.journal, self._owns_journal = open_journal(journal)
        self._owns_client = client is None
        self.client: ClientT = (
            client if client is not None else self._client_class(**client_options)
        )
        self.policy = policy or RetryPolicy()
        self.profile = profile
        self.host_id = host
        """This host's name in lease owners."""
        self._redacted_params = given_params
        # A subclass of the client may change a request in its own ``send`` (an SDK that
        # sets its own key or signs the URL), after the journal and before any hook: its
        # attempts are always gated. Only httpx's (or httpx2's) own class can be quiet.
        stock = type(self.client) is self._client_class or (
            self._httpx2 and type(self.client) is getattr(_httpx2.httpx2_module(), name)
        )
        self._engine = Engine(
            policy=self.policy,
            profile=profile,
            profile_rule=profile_rule,
            clock=clock,
            redact_headers=redaction_set(redact_headers),
            fingerprint_headers=tuple(fingerprint_headers),
            lease_duration=float(lease_duration),
            host_id=host,
            key_expiry_margin=None if key_expiry_margin is None else float(key_expiry_margin),
            namespace=self.journal._namespace,
            hooks=checked_hooks,
            codec=self.journal.codec,
            secret_params=self.journal.redact_query,
            param_values=self._param_values,
            pauses=self.journal._pause_board,
            max_response_bytes=max_response_bytes,
            quiet_client=self._quiet_client if stock else None,
        )

    def _quiet_client(self) -> bool:
        """Whether nothing in the client can change a request between the journal and
        the wire: no request hook but the library's own (`_gate.last_hook`), no ``auth``.
        Then a request leaves as journaled, and an attempt whose key is bound to no
        credentials is not gated (the gate would compare it with itself)."""
        client = self.client
        if client.auth is not None:
            return False
        hooks = client.event_hooks["request"]
        return all(hook is last_hook or hook is alast_hook for hook in hooks)

    def _param_values(self, name: str) -> Sequence[str] | None:
        """The live values of a redacted query parameter, for a resume: the session's
        ``redacted_params`` first (the command line's ``--param-env``), then the
        client's ``params``."""
        return values_in_params(self._redacted_params, self.client.params)(name)

    def profile_for(self, operation: Operation) -> ServerProfile:
        """The profile this session reads ``operation``'s answers with (on a resume, a
        reconcile or a call that continues it): the one journaled with it, read as
        ``profile_rule`` says. Raises `StoredProfileError` where that profile cannot
        be used (it disagrees with this session's under ``"checked"``, it was
        journaled before profiles were stored under ``"stored_only"``, its matcher can
        no longer be imported): nothing would be sent for that operation."""
        return profile_for(self._engine, operation)

    def _build(
        self, method: str, url: httpx.URL, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> httpx.Request:
        base = self.client.base_url
        if not url.userinfo and base.userinfo and base.host == url.host:
            # The journal never holds URL credentials: re-apply the live client's.
            url = url.copy_with(username=base.username, password=base.password)
        if self._httpx2:
            built = self.client.build_request(method, str(url), headers=headers, content=body)
            request = _httpx2.to_httpx_request(built)
        else:
            request = self.client.build_request(method, url, headers=headers, content=body)
        if self.client.params:
            # httpx replaces a URL's whole query with the client's params: the journaled
            # query (its own parameters, and the client's as first sent) goes out as it is.
            request.url = url
        return request

    def _timeout(self, timeout: Any) -> Any:
        """httpx's "client default" marker, in the client's own library."""
        if self._httpx2 and timeout is httpx.USE_CLIENT_DEFAULT:
            return _httpx2.httpx2_module().USE_CLIENT_DEFAULT
        return timeout

    def _read_request(self, method: str, url: httpx.URL | str, **parts: Any) -> httpx.Request:
        """A read (GET, HEAD, OPTIONS) built as the client builds it: nothing journaled, no
        key; sent by the engine's read flow, retried as a Transport's reads are."""
        parts["timeout"] = self._timeout(parts["timeout"])
        request = self.client.build_request(method, url, **parts)
        check_timeouts(request)
        return _httpx2.to_httpx_request(request) if self._httpx2 else request

    def _resume_flows(
        self, queue: list[Operation], *, dry_run: bool, base_url: str | None, reconciling: bool
    ) -> list[FlowFactory[ResumeResult]]:
        """One flow per queued operation, for a driver to run (several at once)."""
        from idempotently._flow._groups import Progress
        from idempotently._flow._resume import resume_operation, resume_tracked

        progress = Progress.of(queue)  # None without a group step in the queue
        if progress is not None:
            return [
                functools.partial(
                    resume_tracked,
                    self._engine,
                    listed,
                    self._build,
                    dry_run=dry_run,
                    base_url=base_url,
                    reconciling=reconciling,
                    progress=progress,
                )
                for listed in queue
            ]
        return [
            functools.partial(
                resume_operation,
                self._engine,
                listed,
                self._build,
                dry_run=dry_run,
                base_url=base_url,
                reconciling=reconciling,
            )
            for listed in queue
        ]

    def _call(
        self,
        request: httpx.Request,
        operation_id: str | None,
        idempotency_key: str | None,
        delivery: Delivery,
        deadline_at: float | None,
        *,
        profile: ServerProfile | None = None,
        overrides: str | None = None,
    ) -> Call:
        key = adopted_key(profile or self.profile, request, idempotency_key)
        return Call(
            request,
            operation_id=operation_id,
            key=key,
            delivery=delivery,
            deadline_at=None if deadline_at is None else float(deadline_at),
            overrides=overrides,
        )

    def _built(
        self,
        method: str,
        url: httpx.URL | str,
        *,
        operation_id: Any,
        idempotency_key: Any,
        delivery: Any,
        deadline_at: Any,
        policy: Any = None,
        profile: Any = None,
        **parts: Any,
    ) -> httpx.Request:
        """The request a call (or an enqueue) journals, built as httpx builds it (not yet
        read), every argument checked first: the one place `request`, its async twin
        and `enqueue` render a request."""
        check_call_arguments(
            operation_id=operation_id,
            idempotency_key=idempotency_key,
            delivery=delivery,
            deadline_at=deadline_at,
        )
        check_call_overrides(policy, profile)
        # A lookup finds the object by the id the profile carries into the body.
        parts["json"], parts["data"] = carry_operation_id(
            (profile or self.profile).operation_id_field,
            operation_id,
            json=parts.get("json"),
            data=parts.get("data"),
        )
        return self.client.build_request(method, url, **parts)

    def _prepared(
        self,
        request: httpx.Request,
        *,
        timeout: Any,
        operation_id: str | None,
        idempotency_key: str | None,
        delivery: Delivery,
        deadline_at: float | None,
        policy: RetryPolicy | None,
        profile: ServerProfile | None,
    ) -> tuple[Call, Engine]:
        """The call a read request stands for, with its overrides to journal, and the
        engine that runs it (the session's, or one with the call's policy and profile)."""
        live = _httpx2.to_httpx_request(request) if self._httpx2 else request
        call = self._call(
            live,
            operation_id,
            idempotency_key,
            delivery,
            deadline_at,
            profile=profile,
            overrides=overrides_json(
                policy,
                None
                if timeout is httpx.USE_CLIENT_DEFAULT
                else dict(live.extensions.get("timeout") or {}),
            ),
        )
        if profile is not None:
            check_attempt_header(
                profile, self._engine.fingerprint_headers, self._engine.redact_headers
            )
        return call, self._engine.overridden(policy, profile)

    def _enqueue_request(
        self,
        method: str,
        url: httpx.URL | str,
        *,
        operation_id: object,
        idempotency_key: object,
        deadline_at: object,
        **parts: Any,
    ) -> httpx.Request:
        """The request an enqueue journals, built exactly as `request` builds it
        (not yet read); its arguments checked first."""
        if operation_id is None:
            raise TypeError(
                "enqueue needs an operation_id (e.g. 'order-42:charge'): the relay sends the "
                "operation later, and your transaction may run again; the id is what makes "
                "it one operation"
            )
        return self._built(
            method,
            url,
            operation_id=operation_id,
            idempotency_key=idempotency_key,
            delivery="exactly_once",
            deadline_at=deadline_at,
            **parts,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(journal={self.journal.path!r}, profile={self.profile.name!r})"
        )


def check_call_overrides(policy: object, profile: object) -> None:
    """A call's own ``policy=`` and ``profile=``, checked before anything is journaled:
    both are journaled with the operation, so that resume uses them."""
    if policy is not None:
        check_call_policy(policy)
    if profile is not None:
        if not isinstance(profile, ServerProfile):
            raise TypeError(
                "profile must be an idempotently.ServerProfile (e.g. "
                f"idempotently.profiles.STRIPE), not {type(profile).__name__}"
            )
        journaled_profile(profile)


def adopted_key(
    profile: ServerProfile, request: httpx.Request, idempotency_key: str | None
) -> str | None:
    """The key the caller chose: ``idempotency_key=``, or the profile's header on the request.

    Validated against the profile; a header that disagrees with the argument is an error.
    """
    name = profile.key_header.lower().encode("latin-1")
    values = [value for key, value in request.headers.raw if key.lower() == name]
    raw = None
    if len(values) == 1 and values[0].isascii():
        raw = values[0].decode("ascii")
    elif values:
        raw = request.headers.get(profile.key_header)  # joined and decoded as httpx does
    header_key = None if raw is None else profile.parse_key(raw)
    if idempotency_key is not None and header_key is not None and header_key != idempotency_key:
        raise ValueError(
            f"idempotency_key={idempotency_key!r} disagrees with the {profile.key_header} "
            f"header ({raw!r}); pass one of them"
        )
    key = idempotency_key if idempotency_key is not None else header_key
    if key is not None:
        profile.validate_key(key)
    return key


class Session(_SessionBase[httpx.Client]):
    """An httpx client whose writes carry one journaled idempotency key each.

    ``Session("idempotently.db", base_url=..., headers=...)`` takes any ``httpx.Client``
    option; ``Session("idempotently.db", client=httpx.Client(...))`` wraps an existing
    one. A misspelt option is a ``TypeError`` before the journal is created.
    ``client=httpx2.Client(...)`` works too (install ``idempotently[httpx2]``):
    requests go out through that client, and answers are ``httpx.Response``
    objects as annotated (``session.client`` is the httpx2 client); a network
    error that reaches you is the httpx2 client's own.

    One Session may be shared by threads: one operation is sent by one caller
    at a time; the others wait for its answer (within the policy's deadline)
    or get `OperationInProgressError`.

    ``host_id`` names this host in lease owners (default ``$IDEMPOTENTLY_HOST_ID``,
    else the hostname; printable, no ``:``, at most 128 characters): a lease of
    another host id is waited out until it expires, never judged by its pid.

    ``hooks=[hook, ...]`` are called with every event (`OperationStarted`,
    `AttemptFinished`, `RetryScheduled`, `OperationFinished`)
    in the calling thread (a resume with ``concurrency`` calls them from its
    threads); a hook that raises is logged and the call goes on.

    Args:
        journal: The journal: a path to its SQLite file, a `postgresql://` URL,
            or an open `Journal`.
        client: An `httpx.Client` (or `httpx2.Client`) to send through, instead of
            one built from `client_options`.
        policy: How hard each call tries (`RetryPolicy()` when None).
        profile: How the server spells the contract (`profiles.GENERIC`; see the
            catalog in `idempotently.profiles`).
        redact_headers: More request headers never to journal (credentials such as
            `Authorization` and `X-Api-Key` never are).
        fingerprint_headers: Request headers that take part in the request's
            fingerprint, so a call that differs in them is a `KeyReuseError`.
        lease_duration: Seconds a sender's lease lasts before another process may
            take the operation over (renewed while the attempt runs).
        host_id: This host's name in lease owners (`$IDEMPOTENTLY_HOST_ID`, else
            the hostname).
        key_expiry_margin: Seconds before the key's lifetime ends after which an
            operation is no longer resent, but goes to `needs_reconcile`. None (the
            default): each operation's profile's (`ServerProfile.key_expiry_margin`,
            journaled with it). A given one (at least 60, below the profile's key
            lifetime; with `profile_rule="stored_only"`, below each operation's)
            applies where it is larger (`idempotently resume --key-expiry-margin`).
        profile_rule: How the profile journaled with an operation is read on a
            resume, a reconcile or a call that continues it: `"stored"` (the
            default: the stored one; one journaled before profiles were stored is
            read with `profile`), `"stored_only"` (the stored one; one journaled
            before profiles were stored is refused: `idempotently resume` without
            `--profile`), `"checked"` (`profile`, refused where the stored one
            differs: `--profile`), `"forced"` (`profile`, always: `--profile` with
            `--force-profile`). A refused operation is not sent and keeps its state
            (`StoredProfileError`; a resume reports it `not_sent`); `profile_for`
            says which profile an operation gets, before anything is sent.
        redacted_params: Values of secret query parameters the journal redacted
            (`{"api_key": os.environ["API_KEY"]}`), put back in their place in the
            journaled URL when an operation journaled with that parameter redacted is
            resent; no other request gets them (`idempotently resume --param-env`).
            Looked up before the client's own `params`. Each name a query parameter
            name, each value a non-empty str without surrounding whitespace or
            control characters.
        clock: The time, in seconds since the epoch (inject one in tests).
        sleep: How to wait between attempts (inject one in tests).
        hooks: Functions called with every event.
        max_response_bytes: The largest final answer read and journaled (decoded
            bytes; 100 MiB by default). A larger one, or one still arriving at the
            policy's deadline, is journaled with its status and headers only, and
            the call raises `AnswerNotReadError`; an answer that may be retried
            (5xx, 408, 409, 425, 429) is read no further than a 64 KiB excerpt.
        **client_options: Any `httpx.Client` option (`base_url`, `headers`,
            `timeout`, ...), when `client` is not given.
    """

    _client_class = httpx.Client

    def __init__(
        self,
        journal: JournalArg,
        *,
        client: httpx.Client | httpx2.Client | None = None,
        policy: RetryPolicy | None = None,
        profile: ServerProfile = GENERIC,
        redact_headers: Iterable[str] = (),
        fingerprint_headers: Iterable[str] = (),
        lease_duration: float = DEFAULT_LEASE_DURATION,
        host_id: str | None = None,
        key_expiry_margin: float | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], object] = time.sleep,
        hooks: Iterable[Hook] = (),
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        profile_rule: ProfileRule = "stored",
        redacted_params: Mapping[str, str] | None = None,
        **client_options: Any,
    ) -> None:
        super().__init__(
            journal,
            client=client,
            policy=policy,
            profile=profile,
            redact_headers=redact_headers,
            fingerprint_headers=fingerprint_headers,
            lease_duration=lease_duration,
            host_id=host_id,
            key_expiry_margin=key_expiry_margin,
            clock=clock,
            sleep=sleep,
            client_options=client_options,
            max_response_bytes=max_response_bytes,
            hooks=hooks,
            profile_rule=profile_rule,
            redacted_params=redacted_params,
        )
        self._sleep = sleep

    def post(
        self,
        url: httpx.URL | str,
        *,
        content: RequestContent | None = None,
        data: RequestData | None = None,
        files: RequestFiles | None = None,
        json: Any | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        timeout: TimeoutTypes | UseClientDefault = httpx.USE_CLIENT_DEFAULT,
        extensions: RequestExtensions | None = None,
        operation_id: str | None = None,
        idempotency_key: str | None = None,
        delivery: Delivery = "exactly_once",
        deadline_at: float | None = None,
        policy: RetryPolicy | None = None,
        profile: ServerProfile | None = None,
    ) -> httpx.Response:
        """POST once, whatever happens on the wire; see `request`."""
        return self.request(
            "POST",
            url,
            content=content,
            data=data,
            files=files,
            json=json,
            params=params,
            headers=headers,
            cookies=cookies,
            timeout=timeout,
            extensions=extensions,
            operation_id=operation_id,
            idempotency_key=idempotency_key,
            delivery=delivery,
            deadline_at=deadline_at,
            policy=policy,
            profile=profile,
        )

    def request(
        self,
        method: str,
        url: httpx.URL | str,
        *,
        content: RequestContent | None = None,
        data: RequestData | None = None,
        files: RequestFiles | None = None,
        json: Any | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        timeout: TimeoutTypes | UseClientDefault = httpx.USE_CLIENT_DEFAULT,
        extensions: RequestExtensions | None = None,
        operation_id: str | None = None,
        idempotency_key: str | None = None,
        delivery: Delivery = "exactly_once",
        deadline_at: float | None = None,
        policy: RetryPolicy | None = None,
        profile: ServerProfile | None = None,
    ) -> httpx.Response:
        """Send one operation; return its final answer (2xx, 3xx or a final 4xx).

        The key is journaled before the first byte is sent. ``operation_id``
        makes the call repeatable across restarts: a settled operation returns
        its stored response without a network call, a pending one continues
        with its stored key. ``idempotency_key`` (or the profile's key header
        set on the request) is used as the key instead of a random one.
        ``deadline_at`` (seconds since the epoch) is the operation's own
        deadline, kept across restarts. ``policy=``, ``profile=`` and ``timeout=``
        replace the session's for this call, and are journaled with the
        operation: a resume sends it under them too (a policy with a custom
        ``wait=`` or ``stop=`` cannot be journaled and is refused).
        """
        ids: dict[str, Any] = {
            "operation_id": operation_id,
            "idempotency_key": idempotency_key,
            "delivery": delivery,
            "deadline_at": deadline_at,
            "policy": policy,
            "profile": profile,
        }
        request = self._built(
            method,
            url,
            **ids,
            content=content,
            data=data,
            files=files,
            json=json,
            params=params,
            headers=headers,
            cookies=cookies,
            timeout=self._timeout(timeout),
            extensions=extensions,
        )
        return self._operate(request, timeout, ids)

    def _operate(
        self,
        request: httpx.Request,
        timeout: TimeoutTypes | UseClientDefault,
        ids: dict[str, Any],
        group: str | None = None,
    ) -> httpx.Response:
        """Journal and send one built request: a call's, or a group's step (``group``)."""
        check_timeouts(request)
        request.read()
        call, engine = self._prepared(request, timeout=timeout, **ids)
        if group is not None:
            call = attrs.evolve(call, group=group)
        held = Held()
        try:
            return run(
                engine.call(call, self._build, held),
                held,
                self.journal,
                send=self._send,
                sleep=self._sleep,
            )
        except Exception as error:
            raise _httpx2.in_library_of(self.client, error)  # noqa: B904 (its cause is kept)

    def group(self, group_id: str) -> Group:
        """The steps of one multi-step operation: ``group.post(url, ..., step="charge")``
        is the operation ``f"{group_id}/charge"``, sent only once every earlier step of
        the group has succeeded; a rerun returns settled steps' stored answers and goes
        on at the first unsettled one (see `Group`; docs/groups.md)."""
        from idempotently._group import Group

        return Group(self, group_id)

    def enqueue(
        self,
        method: str,
        url: httpx.URL | str,
        *,
        operation_id: str,
        content: RequestContent | None = None,
        data: RequestData | None = None,
        files: RequestFiles | None = None,
        json: Any | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        idempotency_key: str | None = None,
        deadline_at: float | None = None,
        connection: Any = None,
    ) -> Operation:
        """Journal an operation to be sent later, exactly as `request` would send it,
        and send nothing: the client-side outbox.

        With ``connection`` (your own open connection, inside your own transaction, on
        the journal's database: a ``sqlite3.Connection`` or ``sqlite_utils.Database`` on
        the journal's file, a ``psycopg.Connection`` for a PostgreSQL journal, a
        SQLAlchemy ``Session`` or ``Connection``, or Django's connection inside
        ``transaction.atomic()``), the operation commits or rolls back with your own
        writes; nothing is committed here.
        Without it, the operation is its own durable transaction. ``resume`` (or
        ``idempotently resume --watch``) sends it, once. Until a send begins it is not
        "maybe delivered", and its key's lifetime starts at that first send.

        Returns the journaled `Operation` (its ``operation_id`` and ``key``);
        an ``operation_id`` already journaled returns that operation, unchanged, or
        raises `KeyReuseError` if its request differs. A SQLite write
        transaction of yours that is still open makes every other write to the journal
        wait for it: commit before this Session sends anything.
        """
        request = self._enqueue_request(
            method,
            url,
            operation_id=operation_id,
            idempotency_key=idempotency_key,
            deadline_at=deadline_at,
            content=content,
            data=data,
            files=files,
            json=json,
            params=params,
            headers=headers,
            cookies=cookies,
        )
        return self._enqueued(request, operation_id, idempotency_key, deadline_at, connection)

    def _enqueued(
        self,
        request: httpx.Request,
        operation_id: str,
        idempotency_key: str | None,
        deadline_at: float | None,
        connection: object | None,
        group: str | None = None,
    ) -> Operation:
        """Journal one built request to be sent later: an operation, or a group's step."""
        from idempotently._flow._enqueue import enqueue

        request.read()
        live = _httpx2.to_httpx_request(request) if self._httpx2 else request
        call = self._call(live, operation_id, idempotency_key, "exactly_once", deadline_at)
        if group is not None:
            call = attrs.evolve(call, group=group)
        return run(
            enqueue(self._engine, call, connection),
            Held(),
            self.journal,
            send=self._send,
            sleep=self._sleep,
        )

    # -- reads: unjournaled, retried as a Transport's reads are -------------------------

    def get(
        self,
        url: httpx.URL | str,
        *,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        timeout: TimeoutTypes | UseClientDefault = httpx.USE_CLIENT_DEFAULT,
        extensions: RequestExtensions | None = None,
    ) -> httpx.Response:
        """GET: a read, never journaled and sent without a key. Retried after a network
        error, a 5xx, 408, 425 or 429 (not before its Retry-After) under the session's
        policy and retry budget, as `Transport` retries reads; an answer it retries is
        closed unread. Returns the last answer, read, or raises the last error."""
        parts = {"params": params, "headers": headers, "cookies": cookies}
        return self._read("GET", url, timeout=timeout, extensions=extensions, **parts)

    def head(
        self,
        url: httpx.URL | str,
        *,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        timeout: TimeoutTypes | UseClientDefault = httpx.USE_CLIENT_DEFAULT,
        extensions: RequestExtensions | None = None,
    ) -> httpx.Response:
        """HEAD: a read, unjournaled; see `get`."""
        parts = {"params": params, "headers": headers, "cookies": cookies}
        return self._read("HEAD", url, timeout=timeout, extensions=extensions, **parts)

    def options(
        self,
        url: httpx.URL | str,
        *,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        timeout: TimeoutTypes | UseClientDefault = httpx.USE_CLIENT_DEFAULT,
        extensions: RequestExtensions | None = None,
    ) -> httpx.Response:
        """OPTIONS: a read, unjournaled; see `get`."""
        parts = {"params": params, "headers": headers, "cookies": cookies}
        return self._read("OPTIONS", url, timeout=timeout, extensions=extensions, **parts)

    def _read(self, method: str, url: httpx.URL | str, **parts: Any) -> httpx.Response:
        request = self._read_request(method, url, **parts)
        try:
            response = run(
                retried_read(self._engine, request),
                Held(),
                self.journal,
                send=self._send,
                sleep=self._sleep,
            )
            try:
                response.read()
            finally:
                response.close()
        except Exception as error:
            raise _httpx2.in_library_of(self.client, error)  # noqa: B904 (its cause is kept)
        return response

    def _send(self, request: httpx.Request) -> httpx.Response:
        """One attempt, its answer's body unread: the flow reads it within bounds (and
        the redirects it follows, `_redirects.send`). The client's
        last request hook is the gate (kept last whatever was added since)."""
        keep_last(self.client, last_hook)
        clock = self._engine.clock
        if not self._httpx2:
            response: httpx.Response = _redirects.send(self.client, request, clock)
            return response
        try:
            answer = _redirects.send(
                self.client,
                _httpx2.to_httpx2_request(request),
                clock,
                view=lambda hop: _httpx2.unread_response(hop, request),
            )
        except Exception as error:
            raise _httpx2.to_httpx_error(error) from error
        return _httpx2.unread_response(answer, request)

    def resume(
        self,
        *,
        reconciler: Reconciler | None = None,
        dry_run: bool = False,
        base_url: str | None = None,
        on_result: OnResult | None = None,
        concurrency: int = 1,
    ) -> list[ResumeResult]:
        """Re-drive every pending operation with its stored key and bytes.

        One result per operation, oldest first, each also passed to
        ``on_result`` as soon as it is known: sent and settled, still pending
        (waiting for ``not_before``, leased by another caller, budget spent,
        unresolved, not sent), abandoned (at-most-once), or needs_reconcile
        (key past its lifetime, replayed 5xx, own deadline passed). With a
        ``reconciler``, needs_reconcile operations are handed to it to settle.
        Credentials come from this session's client, never from the journal.
        ``concurrency`` operations are resumed at once (in threads), each under
        its own lease; results keep the queue's order.
        """
        from idempotently._flow._resume import resume_queue
        from idempotently._lookup import BoundReconciler

        check_resume_arguments(
            base_url=base_url, reconciler=reconciler, on_result=on_result, concurrency=concurrency
        )
        reconciling = reconciler is not None
        held = Held()
        queue = run(
            resume_queue(self._engine, reconciling=reconciling),
            held,
            self.journal,
            send=self._send,
            sleep=self._sleep,
        )
        client = self.client
        return run_each(
            self._resume_flows(queue, dry_run=dry_run, base_url=base_url, reconciling=reconciling),
            self.journal,
            concurrency=concurrency,
            send=self._send,
            sleep=self._sleep,
            reconcile=None
            if reconciler is None
            else BoundReconciler.of(reconciler, client, self._engine),
            report=on_result,
        )

    def reconcile(
        self,
        reconciler: Reconciler,
        *,
        on_result: OnResult | None = None,
        concurrency: int = 1,
    ) -> list[ResumeResult]:
        """Hand every needs_reconcile operation to ``reconciler`` (a
        `idempotently.Lookup`, or your own), oldest first; nothing pending is
        resent. One result per operation, each also passed to ``on_result``."""
        from idempotently._flow._reconcile import reconcile_queue
        from idempotently._lookup import BoundReconciler

        check_resume_arguments(
            base_url=None, reconciler=reconciler, on_result=on_result, concurrency=concurrency
        )
        queue = run(
            reconcile_queue(self._engine),
            Held(),
            self.journal,
            send=self._send,
            sleep=self._sleep,
        )
        client = self.client
        return run_each(
            self._resume_flows(queue, dry_run=False, base_url=None, reconciling=True),
            self.journal,
            concurrency=concurrency,
            send=self._send,
            sleep=self._sleep,
            reconcile=BoundReconciler.of(reconciler, client, self._engine),
            report=on_result,
        )

    def watch(
        self,
        stop: threading.Event,
        *,
        interval: float = DEFAULT_WATCH_INTERVAL,
        concurrency: int = 1,
        base_url: str | None = None,
        reconciler: Reconciler | None = None,
        on_result: OnResult | None = None,
        on_batch: Callable[[WatchBatch], object] | None = None,
    ) -> WatchSummary:
        """Keep resuming pending operations as they fall due, until ``stop`` is set:
        the worker ``idempotently resume --watch`` runs (see the fleet guide).

        Each round claims a batch of due operations in one journal transaction, so
        workers on several hosts sharing a journal never resume one operation at once,
        and resumes them ``concurrency`` at a time (in threads) through the same flow
        as `resume`; when nothing is due it waits ``interval`` seconds. An operation a
        round leaves pending with nothing to wait for is retried no sooner than
        ``interval``, doubling. With a ``reconciler``, needs_reconcile operations are
        handed to it as they come, on a thread of their own. Once ``stop`` is set: no
        new claims, operations in flight finish their current attempt, every lease
        the worker holds is released, and the summary is returned. ``on_result`` gets
        each result as soon as it is known (from the worker's threads, one at a
        time), ``on_batch`` each round that claimed something; the worker logs its
        events to the ``idempotently.watch`` logger. A journal error ends it (after
        releasing what it can) and is raised. A ``stop`` that is no
        ``threading.Event``, or an ``interval`` that is not above 0 and at most a
        century, is a TypeError or ValueError before anything is claimed. It installs
        no signal handler: map your process's signals onto ``stop``.
        """
        from idempotently._lookup import BoundReconciler
        from idempotently._watch import check_watch_arguments, watch

        check_watch_arguments(stop=stop, interval=interval)
        check_resume_arguments(
            base_url=base_url, reconciler=reconciler, on_result=on_result, concurrency=concurrency
        )
        if on_batch is not None and not callable(on_batch):
            raise TypeError(f"on_batch must be callable, not {type(on_batch).__name__}")
        journal = self.journal
        return watch(
            self._engine,
            journal,
            self._build,
            send=self._send,  # its answers' bodies read within bounds, as a call's
            stop=stop,
            interval=float(interval),
            concurrency=concurrency,
            base_url=base_url,
            on_result=on_result,
            on_batch=on_batch,
            pending_left=lambda: journal.counts()["pending"],
            reconcile=None
            if reconciler is None
            else BoundReconciler.of(reconciler, self.client, self._engine),
        )

    def close(self) -> None:
        if self._owns_client:
            self.client.close()
        if self._owns_journal:
            self.journal.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


MAX_RESUME_CONCURRENCY = 256


def check_origin(base_url: str | httpx.URL) -> httpx.URL:
    """An http(s) origin with a host and a port that exists; ValueError saying why not."""
    try:
        url = httpx.URL(base_url)
        port = url.port
    except (httpx.InvalidURL, ValueError) as error:
        raise ValueError(f"base_url {str(base_url)[:200]!r} is not a URL: {error}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(
            f"base_url must be an http(s) origin like https://host:port, not "
            f"{str(base_url)[:200]!r}; nothing was resent"
        )
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"base_url port must be 1 to 65535, not {port}; nothing was resent")
    return url


def check_resume_arguments(
    *, base_url: object, reconciler: object, on_result: object, concurrency: object
) -> None:
    if isinstance(concurrency, bool) or not isinstance(concurrency, int):
        raise TypeError(f"concurrency must be an int, not {type(concurrency).__name__}")
    if not 1 <= concurrency <= MAX_RESUME_CONCURRENCY:
        raise ValueError(f"concurrency must be 1 to {MAX_RESUME_CONCURRENCY}, not {concurrency}")
    if base_url is not None:
        if not isinstance(base_url, (str, httpx.URL)):
            raise TypeError(f"base_url must be a str, not {type(base_url).__name__}")
        check_origin(base_url)
    for name, function in (("reconciler", reconciler), ("on_result", on_result)):
        if function is not None and not callable(function):
            raise TypeError(f"{name} must be callable, not {type(function).__name__}")


class AsyncSession(_SessionBase[httpx.AsyncClient]):
    """The async twin of `Session`, on asyncio or trio (anyio).

    Journal reads and writes never run on the event loop: its tasks' writes join
    the journal's one writer, whose thread commits them together (so concurrent
    keys share an fsync) and wakes the loop; reads run in a worker thread. The
    loop never waits for a lock, an fsync or a database. Tasks sharing one
    AsyncSession send one operation once.

    ``hooks=`` take plain or async functions; they run on the event loop, between
    one journal write and the next step, so keep them quick (hand slow work to a
    task or a queue).

    Args:
        journal: As for `Session`.
        client: An `httpx.AsyncClient` (or `httpx2.AsyncClient`) to send through.
        policy: How hard each call tries (`RetryPolicy()` when None).
        profile: How the server spells the contract (`profiles.GENERIC`; see the
            catalog in `idempotently.profiles`).
        redact_headers: More request headers never to journal (credentials such as
            `Authorization` and `X-Api-Key` never are).
        fingerprint_headers: Request headers that take part in the request's
            fingerprint, so a call that differs in them is a `KeyReuseError`.
        lease_duration: Seconds a sender's lease lasts before another process may
            take the operation over (renewed while the attempt runs).
        host_id: This host's name in lease owners (`$IDEMPOTENTLY_HOST_ID`, else
            the hostname).
        key_expiry_margin: Seconds before the key's lifetime ends after which an
            operation is no longer resent, but goes to `needs_reconcile`. None (the
            default): each operation's profile's (`ServerProfile.key_expiry_margin`,
            journaled with it). A given one (at least 60, below the profile's key
            lifetime; with `profile_rule="stored_only"`, below each operation's)
            applies where it is larger (`idempotently resume --key-expiry-margin`).
        profile_rule: How the profile journaled with an operation is read on a
            resume, a reconcile or a call that continues it: `"stored"` (the
            default: the stored one; one journaled before profiles were stored is
            read with `profile`), `"stored_only"` (the stored one; one journaled
            before profiles were stored is refused: `idempotently resume` without
            `--profile`), `"checked"` (`profile`, refused where the stored one
            differs: `--profile`), `"forced"` (`profile`, always: `--profile` with
            `--force-profile`). A refused operation is not sent and keeps its state
            (`StoredProfileError`; a resume reports it `not_sent`); `profile_for`
            says which profile an operation gets, before anything is sent.
        redacted_params: Values of secret query parameters the journal redacted
            (`{"api_key": os.environ["API_KEY"]}`), put back in their place in the
            journaled URL when an operation journaled with that parameter redacted is
            resent; no other request gets them (`idempotently resume --param-env`).
            Looked up before the client's own `params`. Each name a query parameter
            name, each value a non-empty str without surrounding whitespace or
            control characters.
        clock: The time, in seconds since the epoch (inject one in tests).
        sleep: How to wait between attempts: a coroutine function (`anyio.sleep`).
        hooks: Plain or async functions called with every event.
        max_response_bytes: The largest final answer read and journaled (decoded
            bytes; 100 MiB by default). A larger one, or one still arriving at the
            policy's deadline, is journaled with its status and headers only, and
            the call raises `AnswerNotReadError`; an answer that may be retried
            (5xx, 408, 409, 425, 429) is read no further than a 64 KiB excerpt.
        **client_options: Any `httpx.AsyncClient` option, when `client` is not given.
    """

    _client_class = httpx.AsyncClient

    def __init__(
        self,
        journal: JournalArg,
        *,
        client: httpx.AsyncClient | httpx2.AsyncClient | None = None,
        policy: RetryPolicy | None = None,
        profile: ServerProfile = GENERIC,
        redact_headers: Iterable[str] = (),
        fingerprint_headers: Iterable[str] = (),
        lease_duration: float = DEFAULT_LEASE_DURATION,
        host_id: str | None = None,
        key_expiry_margin: float | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[object]] = anyio.sleep,
        hooks: Iterable[AsyncHook] = (),
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        profile_rule: ProfileRule = "stored",
        redacted_params: Mapping[str, str] | None = None,
        **client_options: Any,
    ) -> None:
        super().__init__(
            journal,
            client=client,
            policy=policy,
            profile=profile,
            redact_headers=redact_headers,
            fingerprint_headers=fingerprint_headers,
            lease_duration=lease_duration,
            host_id=host_id,
            key_expiry_margin=key_expiry_margin,
            clock=clock,
            sleep=sleep,
            client_options=client_options,
            max_response_bytes=max_response_bytes,
            hooks=hooks,
            profile_rule=profile_rule,
            redacted_params=redacted_params,
        )
        self._sleep = sleep

    async def post(
        self,
        url: httpx.URL | str,
        *,
        content: RequestContent | None = None,
        data: RequestData | None = None,
        files: RequestFiles | None = None,
        json: Any | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        timeout: TimeoutTypes | UseClientDefault = httpx.USE_CLIENT_DEFAULT,
        extensions: RequestExtensions | None = None,
        operation_id: str | None = None,
        idempotency_key: str | None = None,
        delivery: Delivery = "exactly_once",
        deadline_at: float | None = None,
        policy: RetryPolicy | None = None,
        profile: ServerProfile | None = None,
    ) -> httpx.Response:
        """POST once, whatever happens on the wire; see `Session.request`."""
        return await self.request(
            "POST",
            url,
            content=content,
            data=data,
            files=files,
            json=json,
            params=params,
            headers=headers,
            cookies=cookies,
            timeout=timeout,
            extensions=extensions,
            operation_id=operation_id,
            idempotency_key=idempotency_key,
            delivery=delivery,
            deadline_at=deadline_at,
            policy=policy,
            profile=profile,
        )

    async def request(
        self,
        method: str,
        url: httpx.URL | str,
        *,
        content: RequestContent | None = None,
        data: RequestData | None = None,
        files: RequestFiles | None = None,
        json: Any | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        timeout: TimeoutTypes | UseClientDefault = httpx.USE_CLIENT_DEFAULT,
        extensions: RequestExtensions | None = None,
        operation_id: str | None = None,
        idempotency_key: str | None = None,
        delivery: Delivery = "exactly_once",
        deadline_at: float | None = None,
        policy: RetryPolicy | None = None,
        profile: ServerProfile | None = None,
    ) -> httpx.Response:
        """Send one operation; see `Session.request`."""
        ids: dict[str, Any] = {
            "operation_id": operation_id,
            "idempotency_key": idempotency_key,
            "delivery": delivery,
            "deadline_at": deadline_at,
            "policy": policy,
            "profile": profile,
        }
        request = self._built(
            method,
            url,
            **ids,
            content=content,
            data=data,
            files=files,
            json=json,
            params=params,
            headers=headers,
            cookies=cookies,
            timeout=self._timeout(timeout),
            extensions=extensions,
        )
        return await self._operate(request, timeout, ids)

    async def _operate(
        self,
        request: httpx.Request,
        timeout: TimeoutTypes | UseClientDefault,
        ids: dict[str, Any],
        group: str | None = None,
    ) -> httpx.Response:
        """Journal and send one built request: a call's, or a group's step (``group``)."""
        check_timeouts(request)
        await request.aread()
        call, engine = self._prepared(request, timeout=timeout, **ids)
        if group is not None:
            call = attrs.evolve(call, group=group)
        held = Held()
        try:
            return await arun(
                engine.call(call, self._build, held),
                held,
                self.journal,
                send=self._send,
                sleep=self._sleep,
            )
        except Exception as error:
            raise _httpx2.in_library_of(self.client, error)  # noqa: B904 (its cause is kept)

    def group(self, group_id: str) -> AsyncGroup:
        """The steps of one multi-step operation; see `Session.group` (`AsyncGroup`)."""
        from idempotently._group import AsyncGroup

        return AsyncGroup(self, group_id)

    async def enqueue(
        self,
        method: str,
        url: httpx.URL | str,
        *,
        operation_id: str,
        content: RequestContent | None = None,
        data: RequestData | None = None,
        files: RequestFiles | None = None,
        json: Any | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        idempotency_key: str | None = None,
        deadline_at: float | None = None,
        connection: Any = None,
    ) -> Operation:
        """Journal an operation to be sent later; see `Session.enqueue`.

        ``connection`` is a ``psycopg.AsyncConnection`` for a PostgreSQL journal or a
        SQLAlchemy ``AsyncSession`` or ``AsyncConnection`` on either (their statements
        are awaited on this event loop), or a ``sqlite3.Connection`` on the
        journal's file, used where you use it: on the loop's thread, as your own
        statements on it are (it commits nothing, so it never waits for an fsync).
        Without ``connection`` the write runs off the loop, as every journal write does.
        """
        request = self._enqueue_request(
            method,
            url,
            operation_id=operation_id,
            idempotency_key=idempotency_key,
            deadline_at=deadline_at,
            content=content,
            data=data,
            files=files,
            json=json,
            params=params,
            headers=headers,
            cookies=cookies,
        )
        return await self._enqueued(request, operation_id, idempotency_key, deadline_at, connection)

    async def _enqueued(
        self,
        request: httpx.Request,
        operation_id: str,
        idempotency_key: str | None,
        deadline_at: float | None,
        connection: object | None,
        group: str | None = None,
    ) -> Operation:
        """Journal one built request to be sent later: an operation, or a group's step."""
        from idempotently._flow._enqueue import enqueue

        await request.aread()
        live = _httpx2.to_httpx_request(request) if self._httpx2 else request
        call = self._call(live, operation_id, idempotency_key, "exactly_once", deadline_at)
        if group is not None:
            call = attrs.evolve(call, group=group)
        return await arun(
            enqueue(self._engine, call, connection),
            Held(),
            self.journal,
            send=self._send,
            sleep=self._sleep,
        )

    # -- reads: unjournaled, retried as an AsyncTransport's reads are --------------------

    async def get(
        self,
        url: httpx.URL | str,
        *,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        timeout: TimeoutTypes | UseClientDefault = httpx.USE_CLIENT_DEFAULT,
        extensions: RequestExtensions | None = None,
    ) -> httpx.Response:
        """GET: a read, never journaled and sent without a key; see `Session.get`."""
        parts = {"params": params, "headers": headers, "cookies": cookies}
        return await self._read("GET", url, timeout=timeout, extensions=extensions, **parts)

    async def head(
        self,
        url: httpx.URL | str,
        *,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        timeout: TimeoutTypes | UseClientDefault = httpx.USE_CLIENT_DEFAULT,
        extensions: RequestExtensions | None = None,
    ) -> httpx.Response:
        """HEAD: a read, unjournaled; see `Session.get`."""
        parts = {"params": params, "headers": headers, "cookies": cookies}
        return await self._read("HEAD", url, timeout=timeout, extensions=extensions, **parts)

    async def options(
        self,
        url: httpx.URL | str,
        *,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        timeout: TimeoutTypes | UseClientDefault = httpx.USE_CLIENT_DEFAULT,
        extensions: RequestExtensions | None = None,
    ) -> httpx.Response:
        """OPTIONS: a read, unjournaled; see `Session.get`."""
        parts = {"params": params, "headers": headers, "cookies": cookies}
        return await self._read("OPTIONS", url, timeout=timeout, extensions=extensions, **parts)

    async def _read(self, method: str, url: httpx.URL | str, **parts: Any) -> httpx.Response:
        request = self._read_request(method, url, **parts)
        try:
            response = await arun(
                retried_read(self._engine, request),
                Held(),
                self.journal,
                send=self._send,
                sleep=self._sleep,
            )
            try:
                await response.aread()
            finally:
                await response.aclose()
        except Exception as error:
            raise _httpx2.in_library_of(self.client, error)  # noqa: B904 (its cause is kept)
        return response

    async def _send(self, request: httpx.Request) -> httpx.Response:
        """One attempt, its answer's body unread: the flow reads it within bounds (and
        the redirects it follows, `_redirects.asend`). The client's
        last request hook is the gate (kept last whatever was added since)."""
        keep_last(self.client, alast_hook)
        clock = self._engine.clock
        if not self._httpx2:
            response: httpx.Response = await _redirects.asend(self.client, request, clock)
            return response
        try:
            answer = await _redirects.asend(
                self.client,
                _httpx2.to_httpx2_request(request),
                clock,
                view=lambda hop: _httpx2.unread_response(hop, request, asynchronous=True),
            )
        except Exception as error:
            raise _httpx2.to_httpx_error(error) from error
        return _httpx2.unread_response(answer, request, asynchronous=True)

    async def resume(
        self,
        *,
        reconciler: AsyncReconciler | None = None,
        dry_run: bool = False,
        base_url: str | None = None,
        on_result: OnResult | None = None,
        concurrency: int = 1,
    ) -> list[ResumeResult]:
        """Re-drive every pending operation; see `Session.resume` (``concurrency``
        operations at once, as tasks)."""
        from idempotently._flow._resume import resume_queue
        from idempotently._lookup import BoundReconciler

        check_resume_arguments(
            base_url=base_url, reconciler=reconciler, on_result=on_result, concurrency=concurrency
        )
        reconciling = reconciler is not None
        held = Held()
        queue = await arun(
            resume_queue(self._engine, reconciling=reconciling),
            held,
            self.journal,
            send=self._send,
            sleep=self._sleep,
        )
        return await arun_each(
            self._resume_flows(queue, dry_run=dry_run, base_url=base_url, reconciling=reconciling),
            self.journal,
            concurrency=concurrency,
            send=self._send,
            sleep=self._sleep,
            reconcile=None
            if reconciler is None
            else BoundReconciler.of(reconciler, self.client, self._engine),
            report=on_result,
        )

    async def reconcile(
        self,
        reconciler: AsyncReconciler,
        *,
        on_result: OnResult | None = None,
        concurrency: int = 1,
    ) -> list[ResumeResult]:
        """Hand every needs_reconcile operation to ``reconciler``; see
        `Session.reconcile`."""
        from idempotently._flow._reconcile import reconcile_queue
        from idempotently._lookup import BoundReconciler

        check_resume_arguments(
            base_url=None, reconciler=reconciler, on_result=on_result, concurrency=concurrency
        )
        queue = await arun(
            reconcile_queue(self._engine),
            Held(),
            self.journal,
            send=self._send,
            sleep=self._sleep,
        )
        return await arun_each(
            self._resume_flows(queue, dry_run=False, base_url=None, reconciling=True),
            self.journal,
            concurrency=concurrency,
            send=self._send,
            sleep=self._sleep,
            reconcile=BoundReconciler.of(reconciler, self.client, self._engine),
            report=on_result,
        )

    async def aclose(self) -> None:
        if self._owns_client:
            await self.client.aclose()
        if self._owns_journal:
            # In a thread: closing a PostgreSQL journal's pool waits for its workers.
            await anyio.to_thread.run_sync(self.journal.close)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

"""The operation flow: one sans-I/O core for calls, transports and resume.

Like httpx's ``auth_flow`` or h11, the flow does no I/O. It is a generator
that yields commands (``_commands.py``): send this request, sleep this long, make
this journal write durable, report this result; and receives their results.
The drivers (``_drivers.py``) decide how: the sync one inline, the async one
with every journal command off its event loop. The same flow serves
``Session.request``, ``Transport.handle_request`` and ``resume``.

One room per use case, each importing only the rooms below it:

- ``_engine.py``: the `Engine` (a Session's configuration, ``_config.py``) with one
  call's path: journal the operation, then attempt until the decision settles;
- ``_resume.py``, ``_reconcile.py``, ``_read.py``, ``_enqueue.py``: the other use
  cases, functions taking the engine;
- ``_operation.py``: what they share about one operation (blocked? its request
  rebuilt, its stored answer);
- ``_checks.py``: the faces' argument checks; ``_leases.py``: the lease registry,
  the one part that asks the operating system.
"""

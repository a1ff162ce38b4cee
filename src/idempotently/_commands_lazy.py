"""The commands a call never yields, named lazily: ``_commands_lazy.Act`` loads
``_commands_rare.py`` the first time one of them is named (PEP 562).

A ``match`` on a call's path (the drivers, `Journal._execute`, the stores) names them
last, as ``_commands_lazy.Act()``: a class pattern is looked up only when the match
reaches it, so a call never pays for making their classes. Anywhere else, import them
from ``_commands_rare`` itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from idempotently._commands_rare import (
        Act as Act,
    )
    from idempotently._commands_rare import (
        AuditNote as AuditNote,
    )
    from idempotently._commands_rare import (
        AuditTrail as AuditTrail,
    )
    from idempotently._commands_rare import (
        Command as Command,
    )
    from idempotently._commands_rare import (
        ForksTaken as ForksTaken,
    )
    from idempotently._commands_rare import (
        GroupSteps as GroupSteps,
    )
    from idempotently._commands_rare import (
        JournalCommand as JournalCommand,
    )
    from idempotently._commands_rare import (
        LookUpLater as LookUpLater,
    )
    from idempotently._commands_rare import (
        PlanReconcile as PlanReconcile,
    )
    from idempotently._commands_rare import (
        Queue as Queue,
    )
    from idempotently._commands_rare import (
        Read as Read,
    )
    from idempotently._commands_rare import (
        Reconcile as Reconcile,
    )
    from idempotently._commands_rare import (
        ReconcilePlan as ReconcilePlan,
    )
    from idempotently._commands_rare import (
        Report as Report,
    )
    from idempotently._commands_rare import (
        SwapPause as SwapPause,
    )
    from idempotently._commands_rare import (
        Unpause as Unpause,
    )
    from idempotently._commands_rare import (
        Write as Write,
    )

_RARE = frozenset(
    {
        "Act",
        "AuditNote",
        "AuditTrail",
        "Command",
        "ForksTaken",
        "GroupSteps",
        "JournalCommand",
        "LookUpLater",
        "PlanReconcile",
        "Queue",
        "Read",
        "Reconcile",
        "ReconcilePlan",
        "Report",
        "SwapPause",
        "Unpause",
        "Write",
    }
)


def __getattr__(name: str) -> Any:
    if name not in _RARE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from idempotently import _commands_rare

    value = getattr(_commands_rare, name)
    globals()[name] = value
    return value

"""How ``idempotently show GROUP`` draws an operation group: its steps in order, where it
stopped, which step is next and whether the application must run the group again to
journal it. Loaded by the CLI only when a name is a group's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from idempotently._cli_format import iso, one_line, operation_json
from idempotently._flow._groups import next_step, step_name, stopped_at
from idempotently._rows import Operation


def group_state(steps: Sequence[Operation]) -> dict[str, Any]:
    """Where the group is: stopped at a step, next at a step (journaled, so resume or a
    rerun sends it), or done with what is journaled (the application runs the group
    again to journal any later step)."""
    stop = stopped_at(steps)
    following = None if stop is not None else next_step(steps)
    return {
        "stopped_at": None if stop is None else step_name(stop),
        "stopped_status": None if stop is None else stop.status,
        "next_step": None if following is None else step_name(following),
        "next_status": None if following is None else following.status,
        "rerun_to_continue": stop is None and following is None,
    }


def group_json(group_id: str, steps: Sequence[Operation]) -> dict[str, Any]:
    """``show GROUP --json``."""
    return {
        "group_id": group_id,
        **group_state(steps),
        "steps": [
            {
                "step": operation.step,
                "name": step_name(operation),
                "successor": operation.successor,
                "damaged": operation.damaged,
                **operation_json(operation),
            }
            for operation in steps
        ],
    }


def group_lines(group_id: str, steps: Sequence[Operation]) -> list[str]:
    """``show GROUP`` for people (and piped: the same lines, each field on one line)."""
    state = group_state(steps)
    lines = [f"group {one_line(group_id)}: {len(steps)} journaled step(s)"]
    for operation in steps:
        place = "?" if operation.step is None else str(operation.step)
        status: str = operation.status
        if operation.damaged is not None:
            status = f"its row cannot be read: {operation.damaged}"
        elif operation.reason:
            status += f" ({operation.reason})"
        extra = f", replaced by {operation.successor}" if operation.successor else ""
        lines.append(
            one_line(
                f"  {place:>3}  {step_name(operation)}  {operation.operation_id}  "
                f"{status}{extra}  created {iso(operation.created_at)}"
            )
        )
    if state["stopped_at"] is not None:
        lines.append(
            one_line(
                f"stopped at: {state['stopped_at']} ({state['stopped_status']}): no later "
                "step is ever sent; what to undo of the steps that succeeded is yours"
            )
        )
    elif state["next_step"] is not None:
        lines.append(
            one_line(
                f"next: {state['next_step']} ({state['next_status']}): resume sends it, or "
                "run the group again"
            )
        )
    else:
        lines.append(
            "every journaled step succeeded: a later step is journaled only when the "
            "application runs the group again"
        )
    return lines

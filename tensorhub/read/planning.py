"""The plan phase of a fetch: ask the version's coordinator for our part of its plan,
and while the chunks flow ask again on :class:`~tensorhub.protocol.reading.PlanFollow`'s
schedule, handing a newer plan to the transfer (:meth:`Transfer.replan`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import NamedTuple

import trio

from ..errors import TransportError
from ..model import VersionKey
from ..protocol.reading import Plan, PlanFollow, PlanStamp, plan_of
from .ports import Ports
from .report import FetchReport
from .transfer import Transfer, first_error


class PlanAnswer(NamedTuple):
    """Our part of a plan, a note on it (or why there is none), its stamp (None: no
    plan), and the route the coordinator says our DC's bytes take ("" without a plan;
    ``FetchReport.route``)."""

    plan: Plan
    note: str
    stamp: PlanStamp | None
    route: str = ""


async def ask_plan(ports: Ports, me: str, key: VersionKey, size: int, chunks: int
                   ) -> PlanAnswer:
    """Our part of the coordinator's plan for ``key`` of ``size`` bytes in ``chunks``
    chunks; on any failure no plan (the fetch then picks holders itself) and why."""
    try:
        answer = await ports.ask_coordinator(key, size, chunks)
    except TransportError as exc:
        return PlanAnswer([], f"no plan: {exc}", None)
    plan, note, stamp = plan_of(answer, ports.members(), me)
    return PlanAnswer(plan, note, stamp, answer.route if stamp is not None else "")


async def run_following(transfer: Transfer, follow: PlanFollow,
                        ask: Callable[[], Awaitable[PlanAnswer]],
                        measure: Callable[[], None] | None = None) -> FetchReport:
    """Run ``transfer``; meanwhile ask again (``ask``) as ``follow`` schedules, take a
    plan newer than the one followed, and keep the report's ``plan`` note and route.
    ``measure`` runs before each ask: what the transfer measured of the links so far
    goes to the WAN model, so that a link slowing down now reaches the coordinator,
    which may move the remaining stripes (``Planner.reconsider``)."""
    async def follow_plan() -> None:
        while True:
            await trio.sleep(follow.next_delay())  # a schedule, not a wait for an event
            if measure is not None:
                measure()
            answer = await ask()
            if answer.stamp is None or not follow.newer(answer.stamp):
                continue
            moved, ended = transfer.replan(answer.plan)
            follow.took(trio.current_time(), answer.stamp, moved, ended)
            transfer.report.plan, transfer.report.route = follow.note, answer.route

    done: list[FetchReport] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow_plan)
            done.append(await transfer.run())
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    return done[0]

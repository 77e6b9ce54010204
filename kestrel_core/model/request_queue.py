"""The scheduler's policy (vLLM's ``--scheduling-policy``): the order waiting requests are admitted in, and which
running request is preempted.

``fcfs``: requests are admitted in the order they came, a preempted one waits again at the head of the queue, and the
one preempted is the most recently admitted. ``priority``: each request has an integer priority (lower first, 0 by
default); requests are admitted by ``rank``, (priority, arrival), a preempted one waiting in its place by rank; the
running ones are ordered by rank too, so that the one preempted is the worst: the largest priority, the latest to
arrive among equals. A waiting request of better (lower) priority than the worst running one preempts it where the
KV cache has no room for it (``outranked``, ``Scheduler._make_room``), steps fed ahead on a device included; one of
equal priority waits.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from kestrel_core.errors import InvalidRequest, KestrelError

if TYPE_CHECKING:  # the command line reads POLICIES: nothing heavy at import
    from kestrel_core.model.request import Request

FCFS, PRIORITY = "fcfs", "priority"
POLICIES = (FCFS, PRIORITY)


def checked_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise KestrelError(f"the scheduling policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy


def checked_priority(policy: str, priority: object) -> int:
    """``priority`` where ``policy`` takes it; InvalidRequest naming it otherwise: under fcfs, any but 0, in vLLM's
    words (clients match them)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequest(f"priority must be an integer, got {type(priority).__name__}", param="priority")
    if priority != 0 and policy != PRIORITY:
        why = f"Got priority {priority} but Priority scheduling is not enabled. (--scheduling-policy priority)"
        raise InvalidRequest(why, param="priority")
    return priority


def rank(request: Request) -> tuple[int, int]:
    """A request's place under the priority policy: the lower first."""
    return request.priority, request.arrival_index


def outranked(waiting: RequestQueue, running: Sequence[Request], has_room: Callable[[Request], bool]) -> bool:
    """Under the priority policy: whether the next waiting request is of better priority than the worst running one
    and ``has_room`` says the KV cache has no room for it, so that the worst running one is preempted for it."""
    return (
        waiting.policy == PRIORITY
        and bool(waiting)
        and bool(running)
        and waiting[0].priority < max(r.priority for r in running)
        and not has_room(waiting[0])
    )


class RequestQueue:
    """The waiting requests, the next to be admitted first, under ``policy`` (the module docstring)."""

    def __init__(self, policy: str = FCFS) -> None:
        self.policy = checked_policy(policy)
        self._requests: deque[Request] = deque()
        self._arrivals = itertools.count()

    def add(self, request: Request) -> None:
        """A request that has just come: numbered in arrival order, then queued."""
        request.arrival_index = next(self._arrivals)
        self._queue(request, at_head=False)

    def put_back(self, request: Request) -> None:
        """A preempted request: at the head (fcfs) or in its place by rank (priority)."""
        self._queue(request, at_head=True)

    def _queue(self, request: Request, at_head: bool) -> None:
        if self.policy == PRIORITY:
            bisect.insort(self._requests, request, key=rank)
        elif at_head:
            self._requests.appendleft(request)
        else:
            self._requests.append(request)

    def popleft(self) -> Request:
        return self._requests.popleft()

    def remove(self, request: Request) -> None:
        self._requests.remove(request)

    def __getitem__(self, index: int) -> Request:
        return self._requests[index]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

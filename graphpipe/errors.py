"""Exceptions with meaning. The CLI turns any :class:`GraphpipeError` into
one line ``graphpipe: error: ...`` and exit code 2."""

__all__ = [
    "GraphpipeError",
    "InputError",
    "GraphCycleError",
    "FormatError",
    "PlanError",
    "ScheduleError",
    "InfeasibleError",
    "DeadlockError",
]


class GraphpipeError(Exception):
    """Base of every error that is the user's input, not our bug."""


class InputError(GraphpipeError, ValueError):
    """A bad argument or file: the message names the value and the fix."""


class FormatError(InputError):
    """A file of the wrong shape or unknown ``format`` version."""


class GraphCycleError(InputError):
    """The op graph has a cycle; ``cycle`` lists the op names on it."""

    def __init__(self, cycle: list[str]):
        self.cycle = list(cycle)
        super().__init__("graph has a cycle: " + " -> ".join(self.cycle + self.cycle[:1]))


class PlanError(InputError):
    """A stage graph or plan that breaks an invariant (named in the message)."""


class ScheduleError(InputError):
    """A schedule that fails validation; the message holds the device x step grid."""


class DeadlockError(ScheduleError):
    """Simulation or validation found actions that can never run."""


class InfeasibleError(GraphpipeError):
    """No plan/schedule satisfies the constraints (e.g. memory)."""

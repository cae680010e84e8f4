"""Schedules (action lists), the one validator, and the discrete-event simulator (DESIGN §7)."""

from graphpipe.actions import Action, Schedule

__all__ = ["Action", "Schedule"]

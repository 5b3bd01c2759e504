"""Moved to loraplex.protocol (the contract every layer shares); this name stays until the gateway's imports move."""

from loraplex.protocol import BatchPlan, Outcome, PlannedRequest, RequestKind, Step, StepKind

__all__ = ["BatchPlan", "Outcome", "PlannedRequest", "RequestKind", "Step", "StepKind"]

"""Fair share by tenant weight across plans (pure): each tenant's service in weighted tokens, a virtual time.

A request costs its tokens (forward_backward / forward; the part a plan runs) plus REQUEST_CHARGE (so optimizer and
checkpoint steps, which carry no tokens, still count), divided by its tenant's weight. A sample request costs the
tokens it may run, num_samples x (prompt + max_tokens), charged once, in the plan that starts it (its later slices
are free), so a tenant flooding the sampler falls behind the others in training and in sampling alike. The policy takes the candidate
whose tenant has the least virtual time (its ledger value plus what this plan already gave it), so backlogged
tenants' token shares follow their weights (weight 2: twice the tokens of weight 1).

No starvation and no banked credit (as in weighted fair queueing): a tenant that comes back after a pause starts at
the least virtual time of the tenants backlogged now, not at its old, lower value; a light tenant (a trickle of small
steps) therefore always sits at or below the heavy ones and is taken in the first round of the next plan.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from loraplex.protocol import BatchPlan, PlannedRequest, SamplePayload

REQUEST_CHARGE = 1.0  # tokens' worth charged for any request besides its tokens
MIN_WEIGHT = 1e-3  # a weight at or below zero (a bad row) is read as this: still served, rarely


def weight_of(weights: Mapping[str, float], tenant: str) -> float:
    return max(MIN_WEIGHT, weights.get(tenant, 1.0))


def charge_of(r: PlannedRequest) -> float:
    """What taking `r` costs its tenant, before its weight."""
    p = r.payload
    if isinstance(p, SamplePayload):
        return p.num_samples * (len(p.prompt) + p.max_tokens) + REQUEST_CHARGE
    return r.num_tokens + REQUEST_CHARGE


class FairShareLedger:
    def __init__(self) -> None:
        self._vt: dict[str, float] = {}  # tenant -> weighted tokens served (virtual time)

    def view(self, backlogged: Iterable[str]) -> dict[str, float]:
        """Each backlogged tenant's virtual time, lifted to the least among them (no banked credit)."""
        tenants = set(backlogged)
        known = [self._vt[t] for t in tenants if t in self._vt]
        floor = min(known) if known else 0.0
        return {t: max(self._vt.get(t, floor), floor) for t in tenants}

    def charge(
        self,
        plan: BatchPlan,
        weights: Mapping[str, float],
        backlogged: Iterable[str],
        charged: Collection[str] = (),
    ) -> None:
        """Add what `plan` gave each tenant; `backlogged`: the tenants the plan was made for (their lifted values are
        the ones charged); `charged`: request ids paid for in an earlier plan (a sample run's later slices). Tenants
        neither charged nor ahead of the floor are forgotten (they would be lifted anyway)."""
        vt = self.view(backlogged)
        floor = min(vt.values()) if vt else 0.0
        for r in plan.requests:
            if r.request_id in charged:
                continue
            t = r.tenant_id
            vt[t] = vt.get(t, floor) + charge_of(r) / weight_of(weights, t)
        for t, v in self._vt.items():  # idle tenants that were served above the floor keep their lead
            if t not in vt and v > floor:
                vt[t] = v
        # shift everything down so the numbers stay small over a long run (only differences matter)
        low = min(vt.values()) if vt else 0.0
        self._vt = {t: v - low for t, v in vt.items()}

"""The step cost model calibrated online from the pool's measured FORWARD_BACKWARD steps (pure: no I/O, no torch).

The fit is over multipliers of the device's default parameters (dispatch/cost_model.DEFAULT_COST): seconds =
sum_j m_j x default_j x feature_j. Each observation is scaled by the default's prediction, so the least squares
weigh relative errors (a 30 ms step counts as much as a 3 s one), and a ridge term pulls every multiplier towards 1:
a direction the pool never exercises (say, a pool that never mixes) keeps its default instead of drifting. Old
observations fade (forgetting factor), so the fit follows a device that warms up or a workload that changes.
Robust: an observation far from the current fit (a first call compiling kernels, a step behind a swap storm) gets a
Huber weight, so one outlier moves the fit little.
"""

from __future__ import annotations

from collections.abc import Sequence

from loraplex.dispatch.cost_model import CostParams, StepShape, shape_of
from loraplex.protocol import Outcome, Step, StepKind

N = 5  # StepShape features


class OnlineCostModel:
    def __init__(
        self,
        prior: CostParams,
        microbatch_tokens: int = 4096,
        *,
        prior_weight: float = 0.02,
        forgetting: float = 0.99,
        huber: float = 0.25,
        bounds: tuple[float, float] = (0.02, 50.0),
    ) -> None:
        """prior: the device's defaults; prior_weight: how many observations' worth the pull towards them is (small:
        a direction the measurements inform follows them; one they never touch stays at the default); forgetting: each new observation scales the older ones' weight by this; huber: relative residual past which an
        observation is down-weighted; bounds: the multipliers' range (a cost never fits to zero or below)."""
        self.prior = prior
        self.microbatch_tokens = microbatch_tokens
        self._prior = prior.values()
        self._rho = prior_weight
        self._lambda = forgetting
        self._huber = huber
        self._bounds = bounds
        self._a = [[0.0] * N for _ in range(N)]  # sum of weighted z z^T
        self._b = [0.0] * N  # sum of weighted z r
        self._m = [1.0] * N  # the current multipliers
        self.params = prior
        self.observations = 0

    def predict(self, shape: StepShape) -> float:
        return self.params.predict(shape)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One measured step of `shape` that took `seconds`."""
        base = self.prior.predict(shape)
        if seconds <= 0 or base <= 0 or shape.microbatches == 0:
            return
        z = [p * x / base for p, x in zip(self._prior, shape.features(), strict=True)]  # sums to 1
        r = seconds / base
        fitted = max(sum(zj * mj for zj, mj in zip(z, self._m, strict=True)), 1e-9)
        relative = abs(r - fitted) / fitted  # Huber on the relative residual: an outlier pulls at most `huber` x fit
        weight = 1.0 if relative <= self._huber else self._huber / relative
        for i in range(N):
            self._b[i] = self._lambda * self._b[i] + weight * z[i] * r
            row = self._a[i]
            for j in range(N):
                row[j] = self._lambda * row[j] + weight * z[i] * z[j]
        self.observations += 1
        self._m = self._solve()
        self.params = CostParams(*(p * m for p, m in zip(self._prior, self._m, strict=True)))

    def observe_step(self, step: Step, outcomes: Sequence[Outcome], seconds: float) -> None:
        """The executor's per-step callback (workers/executor.PlanExecutor `on_step`): FORWARD_BACKWARD steps only,
        shaped by the requests that ran (a request that failed its validation did no engine work)."""
        if step.kind != StepKind.FORWARD_BACKWARD:
            return
        ok = {o.request_id for o in outcomes if o.ok}
        ran = [r for r in step.requests if r.request_id in ok]
        if ran:
            self.observe(shape_of(ran, self.microbatch_tokens), seconds)

    def _solve(self) -> list[float]:
        """argmin sum w (r - z.m)^2 + rho |m - 1|^2, clamped to the bounds (Gaussian elimination, 5 x 5)."""
        a = [[self._a[i][j] + (self._rho if i == j else 0.0) for j in range(N)] + [self._b[i] + self._rho]
             for i in range(N)]  # fmt: skip
        for col in range(N):
            pivot = max(range(col, N), key=lambda k: abs(a[k][col]))
            a[col], a[pivot] = a[pivot], a[col]
            lead = a[col][col]
            for k in range(col + 1, N):
                f = a[k][col] / lead
                if f:
                    for j in range(col, N + 1):
                        a[k][j] -= f * a[col][j]
        m = [0.0] * N
        for i in range(N - 1, -1, -1):
            m[i] = (a[i][N] - sum(a[i][j] * m[j] for j in range(i + 1, N))) / a[i][i]
        low, high = self._bounds
        return [min(high, max(low, v)) for v in m]

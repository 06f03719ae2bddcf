"""The incident's policy comes from the worker that runs it, not from whoever started it
(issue #22): a local activity at the incident's start returns the worker's policy, made only
safer by the starter's request (RecoveryPolicy.narrowed_by), and the history records it, so
that a replay, or a worker configured otherwise since, runs the incident on the policy it began
with. A drill's worker (RECOVERY_ACCEPT_STARTER_POLICY, the local stack's) takes the starter's."""

from __future__ import annotations

from temporalio import activity

from contracts.models import RecoveryPolicy


class PolicyActivities:
    def __init__(self, policy: RecoveryPolicy, accept_starter_policy: bool) -> None:
        self._policy, self._accept_starter_policy = policy, accept_starter_policy

    @activity.defn
    async def incident_policy(self, requested: RecoveryPolicy) -> RecoveryPolicy:
        return requested if self._accept_starter_policy else self._policy.narrowed_by(requested)

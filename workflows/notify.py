"""Notifications that never hold up a recovery: each is handed to its own NotificationWorkflow, a
child started with ParentClosePolicy.ABANDON, which delivers it with Temporal's retries for up
to a day, whether or not the workflow that sent it is still running.

notify() returns as soon as the child has started (one round trip to the server). The child's id
is `notify-<incident>-<kind>`: sending the same notification twice delivers it once.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError

with workflow.unsafe.imports_passed_through():
    from activities.notify import NotifyActivities
    from contracts.budget import DeliveryResult, Notification

DELIVERY_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(minutes=5),
    non_retryable_error_types=["WebhookRejected"],
)
DELIVERY_DEADLINE = timedelta(hours=24)


def notification_workflow_id(notification: Notification) -> str:
    return f"notify-{notification.incident_id}-{notification.kind}"


@workflow.defn
class NotificationWorkflow:
    @workflow.run
    async def run(self, notification: Notification) -> DeliveryResult:
        return await workflow.execute_activity_method(
            NotifyActivities.deliver_notification,
            notification,
            start_to_close_timeout=timedelta(seconds=30),
            schedule_to_close_timeout=DELIVERY_DEADLINE,
            retry_policy=DELIVERY_RETRY,
            summary=f"POST the {notification.kind} notification of {notification.incident_id} to the webhook",
        )


async def notify(notification: Notification) -> None:
    """Hand the notification over and return at once; its delivery goes on without the caller."""
    try:
        await workflow.start_child_workflow(
            NotificationWorkflow.run,
            notification,
            id=notification_workflow_id(notification),
            parent_close_policy=workflow.ParentClosePolicy.ABANDON,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            static_summary=f"Notify {notification.kind}: {notification.node}",
        )
    except WorkflowAlreadyStartedError:
        workflow.logger.info("notification %s was sent before", notification.delivery_id)

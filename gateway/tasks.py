"""The gateway's Celery tasks: beat prunes the request records (gateway/records.py), and carries every rollout
under way one step on, judged by those records (cluster/operations/rollouts.py, gateway/rollout_figures.py)."""

from celery import shared_task

from cluster.operations.rollouts import carry_on
from gateway import records, rollout_figures


@shared_task(name="gateway.tasks.prune_request_records", ignore_result=True)  # type: ignore[untyped-decorator]  # Celery's
def prune_request_records() -> int:
    return records.prune()


@shared_task(name="gateway.tasks.watch_rollouts", ignore_result=True)  # type: ignore[untyped-decorator]  # Celery's
def watch_rollouts() -> None:
    carry_on(rollout_figures.sides)

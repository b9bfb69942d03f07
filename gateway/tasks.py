"""The gateway's Celery task: beat prunes the request records (gateway/records.py)."""

from celery import shared_task

from gateway import records


@shared_task(name="gateway.tasks.prune_request_records", ignore_result=True)  # type: ignore[untyped-decorator]  # Celery's
def prune_request_records() -> int:
    return records.prune()

from celery import shared_task

from gateway import usage


@shared_task(name="gateway.tasks.flush_usage", ignore_result=True)
def flush_usage():
    return usage.flush()

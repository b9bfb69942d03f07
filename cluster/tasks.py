from celery import shared_task

from cluster import reconciler


@shared_task(name="cluster.tasks.reconcile", ignore_result=True)
def reconcile():
    return reconciler.reconcile()


@shared_task(name="cluster.tasks.reconcile_tick", ignore_result=True)
def reconcile_tick():
    if reconciler.due():
        reconciler.reconcile()

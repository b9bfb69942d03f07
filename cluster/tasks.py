from celery import shared_task

from cluster import reconciler


@shared_task(name="cluster.tasks.reconcile", ignore_result=True)
def reconcile():
    return reconciler.reconcile()


@shared_task(name="cluster.tasks.reconcile_tick", ignore_result=True)
def reconcile_tick():
    if reconciler.due():
        reconciler.reconcile()


@shared_task(name="cluster.tasks.restart_system", ignore_result=True)
def restart_system(actor: str):
    """`POST /api/v1/system/restart/`: the whole restart, from a worker; this worker restarts last."""
    import os
    import socket

    from cluster import system
    from cluster.operations import OperationError
    from llmgw import control

    # the worker registers from its main process; a prefork pool runs this task in a child of it
    mine = {control.process_id("worker"), f"worker@{socket.gethostname()}:{os.getppid()}"}
    me = next((p.id for p in control.processes() if p.id in mine), None)
    try:
        system.restart_system(actor, me=me)
    except OperationError:
        pass  # another restart is running; it does the whole job

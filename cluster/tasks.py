"""The Celery tasks: beat's reconcile tick, the reconciler kicked after a change, the system restart from the API.

The top of the domain: nothing in it imports this module; the work is sent to these tasks by name."""

import os
import socket

from celery import shared_task

from cluster import control, reconciler, system
from cluster.errors import OperationError
from cluster.events import RECONCILE_TASK


@shared_task(name=RECONCILE_TASK, ignore_result=True)
def reconcile():
    return reconciler.reconcile()


@shared_task(name="cluster.tasks.reconcile_tick", ignore_result=True)
def reconcile_tick():
    system.check_interrupted()
    if reconciler.due():
        reconciler.reconcile()


@shared_task(name=system.RESTART_TASK, ignore_result=True)
def restart_system(actor: str, timeout: float | None = None):
    """`POST /api/v1/system/restart/`: the whole restart, from a worker; this worker restarts last."""
    # the worker registers from its main process; a prefork pool runs this task in a child of it
    mine = {control.process_id("worker"), f"worker@{socket.gethostname()}:{os.getppid()}"}
    me = next((p.id for p in control.processes() if p.id in mine), None)
    try:
        system.restart_system(actor, me=me, agent_timeout=timeout or system.AGENT_TIMEOUT,
                              process_timeout=timeout or system.PROCESS_TIMEOUT)
    except OperationError:
        pass  # another restart is running; it does the whole job

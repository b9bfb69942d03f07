"""What every button of the dashboard does around its operation (dashboard/views.py's `action`, and the rollout
page's buttons in dashboard/rollouts.py): a role that may only look is refused with 403 and changes nothing; the
operation's message, or what refused it (OperationError, an invalid form), becomes the page's one message."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse, HttpResponseForbidden

from cluster.errors import OperationError
from cluster.roles import can_change, role_of
from dashboard.forms import FormError


class ConfirmFirst(FormError):
    """A change to confirm before it is made (ground.confirmation): nothing changed yet; the message comes with a
    button that sends the same form again, confirmed."""

    def __init__(self, why: str, request: HttpRequest):
        super().__init__(f"{why}: confirm to go ahead")
        # the form as it was sent, to send again
        values = [(k, v) for k, vs in request.POST.lists() if k not in ("csrfmiddlewaretoken", "confirm") for v in vs]
        self.form = {"url": request.path, "values": values}


def refusal(request, admin: bool = False) -> HttpResponse | None:
    """403 for a user whose role may not change the cluster (with `admin`: who is no admin); None for one who may."""
    if not can_change(request.user):
        return HttpResponseForbidden("your role may only look: changing the cluster needs the operator or admin role",
                                     content_type="text/plain")
    if admin and role_of(request.user) != "admin":
        return HttpResponseForbidden("this needs the admin role", content_type="text/plain")
    return None


def attempt(request, view, *args, **kwargs) -> tuple[bool, dict]:
    """A button's view run: its message (success), or what refused it (error); whether it went through, and the
    extra context it (or a change to confirm first) gives the page."""
    try:
        if any("\x00" in v for _, values in request.POST.lists() for v in values):
            raise FormError("a field holds a NUL character; nothing was changed")
        said = view(request, *args, **kwargs)
        said, extra = said if isinstance(said, tuple) else (said, {})
        messages.success(request, said)
        return True, extra
    except OperationError as exc:
        messages.error(request, str(exc))
    except ConfirmFirst as exc:
        messages.warning(request, str(exc))
        return False, {"confirm": exc.form}
    except FormError as exc:
        messages.error(request, str(exc))
    return False, {}


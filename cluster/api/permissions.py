"""Who may do what over the API: admins and operators change the cluster, viewers only look."""

from rest_framework import authentication, exceptions, permissions

from cluster import throttle
from cluster.clients import CLI_ACTOR, IN_PROCESS, client_address
from cluster.locks import redis_client
from cluster.roles import WRITE_ROLES, role_of


class InProcessAuthentication(authentication.BaseAuthentication):
    """The `llmgw` command on the control plane's host, calling the API in its own process (llmgw.cli.local): it
    holds the database's credentials already, so it acts as an admin, recorded as `cli`. Only a WSGI environ set
    in process carries the key: a request over the network has HTTP_ headers, never this."""

    def authenticate(self, request):
        if request._request.META.get(IN_PROCESS) is not True:
            return None
        from django.contrib.auth.models import User

        return User(username=CLI_ACTOR, is_superuser=True, is_staff=True, is_active=True), IN_PROCESS


class BearerTokenAuthentication(authentication.TokenAuthentication):
    """`Authorization: Bearer <token>` (and DRF's own `Token <token>`)."""

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() not in (b"bearer", self.keyword.lower().encode()):
            return None  # no token: the session, or anonymous
        # an address that keeps guessing waits, whatever it sends (cluster/throttle.py)
        found = throttle.subjects(client_address(request.META))
        wait = throttle.API.shut(found)
        if wait:
            raise exceptions.Throttled(wait, "Too many failed API tokens from your address.")
        try:
            if header[0].lower() == b"bearer":
                if len(header) != 2:
                    raise exceptions.AuthenticationFailed("Invalid bearer header: give exactly one token.")
                return self.authenticate_credentials(header[1].decode("latin-1"))
            return super().authenticate(request)
        except exceptions.AuthenticationFailed:
            throttle.API.failed(redis_client(), found)
            raise

    def authenticate_header(self, request):
        return "Bearer"


class RolePermission(permissions.BasePermission):
    message = "your role may only look: changing the cluster needs the operator or admin role"

    def has_permission(self, request, view):
        role = role_of(request.user)
        if role is None:
            return False
        if request.method in permissions.SAFE_METHODS:
            return True
        needed = getattr(view, "required_role", None)
        if needed == "admin":
            return role == "admin"
        return role in WRITE_ROLES

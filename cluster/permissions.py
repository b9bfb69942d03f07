"""Who may do what over the API: admins and operators change the cluster, viewers only look."""

from rest_framework import authentication, permissions

from cluster.roles import role_of

WRITE_ROLES = {"admin", "operator"}


class BearerTokenAuthentication(authentication.TokenAuthentication):
    """`Authorization: Bearer <token>` (and DRF's own `Token <token>`)."""

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).split()
        if header and header[0].lower() == b"bearer":
            if len(header) != 2:
                from rest_framework import exceptions

                raise exceptions.AuthenticationFailed("Invalid bearer header: give exactly one token.")
            return self.authenticate_credentials(header[1].decode("latin-1"))
        return super().authenticate(request)

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

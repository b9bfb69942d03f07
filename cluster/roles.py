"""Roles, as Django groups: admin (everything), operator (changes the cluster), viewer (looks)."""

ROLES = ("admin", "operator", "viewer")
WRITE_ROLES = frozenset({"admin", "operator"})  # may change the cluster; a viewer only looks


def role_of(user) -> str | None:
    if not user or not user.is_authenticated:
        return None
    if user.is_superuser:
        return "admin"
    names = {g.name for g in user.groups.all()}
    for role in ROLES:
        if role in names:
            return role
    return None


def can_change(user) -> bool:
    """Whether this user may change the cluster (the REST API, the dashboard's buttons, the mirror's files)."""
    return role_of(user) in WRITE_ROLES

"""Roles, as Django groups: admin (everything), operator (changes the cluster), viewer (looks)."""

ROLES = ("admin", "operator", "viewer")


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

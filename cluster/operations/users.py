"""Users: admins, operators and viewers, each with an API token (and a password for the dashboard)."""

from __future__ import annotations

import re
import unicodedata

from django.contrib.auth.models import Group, User
from django.core.exceptions import ValidationError
from django.db import transaction
from rest_framework.authtoken.models import Token

from cluster.errors import Conflict, OperationError
from cluster.events import record
from cluster.models import USER_NAME_HINT, USER_NAME_PATTERN
from cluster.operations.validation import created
from cluster.roles import ROLES

MIN_PASSWORD = 8  # characters


def user_name(name: object) -> str:
    """A user's name as it is kept, or OperationError. Look-alikes are one name: NFKC (full-width letters,
    ligatures), as the login form reads a name (and no two names differ only in case: add_user)."""
    name = unicodedata.normalize("NFKC", name) if isinstance(name, str) else name
    if not isinstance(name, str) or not re.fullmatch(USER_NAME_PATTERN, name):
        raise OperationError(f"invalid user name {name!r}: use {USER_NAME_HINT}")
    return name


def check_password(password: str) -> None:
    if len(password) < MIN_PASSWORD:
        raise OperationError(f"a password needs at least {MIN_PASSWORD} characters")


def add_user(name: str, role: str, actor: str, password: str | None = None) -> tuple[User, str]:
    if role not in ROLES:
        raise OperationError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
    name = user_name(name)
    if password is not None:
        check_password(password)
    with transaction.atomic():
        taken = User.objects.filter(username__iexact=name).values_list("username", flat=True).first()
        if taken is not None:
            raise Conflict(f"a user named {taken!r} already exists")
        user = User(username=name, is_staff=role == "admin", is_superuser=role == "admin")
        if password:
            user.set_password(password)
        else:
            user.set_unusable_password()
        try:
            user.full_clean(exclude=["password"])
        except ValidationError as exc:
            raise OperationError("; ".join(m for ms in exc.message_dict.values() for m in ms)) from None
        created(f"a user named {name!r} already exists", user.save)
        user.groups.add(Group.objects.get_or_create(name=role)[0])
        token = Token.objects.create(user=user)
        record("user.added", actor, f"user {name} added as {role}", subject=name)
    return user, token.key



def api_token(user: User, why: str) -> str:
    """The user's API token (one per user, as DRF keeps them), made if it has none: what `llmgw login` stores."""
    with transaction.atomic():
        token, made = Token.objects.get_or_create(user=user)
        if made:
            record("user.token", f"user:{user.username}", f"user {user.username}: API token made ({why})",
                   subject=user.username)
    return token.key

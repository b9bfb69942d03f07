"""Logging in, to the dashboard and to the Django admin: repeated failures from one address, for one user at one
address, or for one user from many, wait longer each time (cluster/throttle.py), answered 429 with the wait on the
page; a login that gets in makes its address a known place for its user."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth import views as auth_views
from django.contrib.auth.forms import AuthenticationForm
from django.core.exceptions import ValidationError

from cluster import throttle
from cluster.clients import client_address
from cluster.locks import redis_client

if TYPE_CHECKING:  # a mixin of Django's authentication forms
    _Form = AuthenticationForm
else:
    _Form = object


class Throttled(_Form):
    """An authentication form that asks the login door first and tells it of a wrong password."""

    throttled = 0  # seconds to wait, when the door was shut

    def clean(self):
        assert self.request is not None  # the login views bind their request
        redis, address = redis_client(), client_address(self.request.META)
        found = throttle.login_subjects(redis, address, self.data.get("username") or "")
        self.throttled = throttle.LOGIN.shut(found)
        if self.throttled:
            raise ValidationError(
                f"Too many failed logins: try again in {self.throttled} s.", code="throttled"
            )
        try:
            cleaned = super().clean()
        except ValidationError as exc:
            if exc.code == "invalid_login":
                throttle.LOGIN.failed(redis, found)
            raise
        throttle.logged_in(redis, address, self.get_user().username)
        return cleaned


class LoginForm(Throttled, AuthenticationForm):
    pass


class AdminLoginForm(Throttled, AdminAuthenticationForm):
    pass


class LoginView(auth_views.LoginView):
    form_class = LoginForm

    def form_invalid(self, form):
        response = super().form_invalid(form)
        if form.throttled:
            response.status_code = 429
            response["Retry-After"] = str(form.throttled)
        return response

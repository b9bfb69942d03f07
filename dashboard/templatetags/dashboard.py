"""Small template filters for the dashboard: sizes and ages read as in the CLI (ground.units), and a number
input's range as its form checks it."""

from django import template
from django.utils import timezone
from django.utils.html import format_html

from dashboard.forms import Count, KeyCreateForm, ModelSetForm, ProfileSetForm, RolloutStartForm, SettingsForm
from ground.units import format_age, format_duration, format_size

register = template.Library()


@register.filter
def ago(when) -> str:
    """How long ago, short: "12s", "4m", "3h", "2d" (empty for None). Also takes a timedelta."""
    if when is None:
        return ""
    return format_age(when.total_seconds() if hasattr(when, "total_seconds") else (timezone.now() - when).total_seconds())


@register.filter
def size(n) -> str:
    """"316.5 MiB", "2.0 GiB": binary units, named as such."""
    return format_size(n)


@register.filter
def seconds(value) -> str:
    """A latency, short: "85 ms", "1.4 s", "12 s" (empty for None)."""
    if value is None:
        return ""
    if value < 1:
        return f"{value * 1000:.0f} ms"
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"


@register.filter
def duration(value) -> str:
    """Seconds as an operator writes them: "90s", "15m", "2h" (empty for None)."""
    return "" if value is None else format_duration(value)


@register.simple_tag
def name_input(placeholder: str = "", rule: str = "name"):
    """The `name` input of a form that names something: the domain's one rule (cluster.models) as its `pattern`,
    checked by the browser before the server checks the same, and its hint beside it."""
    from cluster.models import NAME_HINT, NAME_PATTERN, USER_NAME_HINT, USER_NAME_PATTERN

    pattern, hint = (USER_NAME_PATTERN, USER_NAME_HINT) if rule == "user" else (NAME_PATTERN, NAME_HINT)
    return format_html('<input name="name" required pattern="{}" title="{}" placeholder="{}" autocapitalize="off">'
                       '<small class="hint">{}</small>', pattern, hint, placeholder, hint)


NUMBER_FORMS = {"model": ModelSetForm, "settings": SettingsForm, "profile": ProfileSetForm, "key": KeyCreateForm,
                "rollout": RolloutStartForm}


@register.simple_tag
def number_range(form: str, field: str) -> str:
    """A number input's min and max: its form field's range (the domain's Bounds), so the browser refuses what
    the server would."""
    number = NUMBER_FORMS[form].base_fields[field]
    if not isinstance(number, Count):
        raise template.TemplateSyntaxError(f"{form}'s {field} is not a whole number")
    return format_html('min="{}" max="{}"', number.bounds.low, number.bounds.high)


@register.filter
def share(value) -> str:
    """A share as a percentage, as the Events and the CLI write it: 0.1 -> "10%" (empty for None)."""
    from cluster.rollouts import percent

    return "" if value is None else percent(value)


@register.filter
def rollout_state(value) -> str:
    """A rollout's state in words: "rolling_back" -> "rolling back"."""
    from cluster.models import Rollout

    return Rollout.State(value).label if value in Rollout.State.values else str(value or "")


@register.filter
def ms(value) -> str:
    """A latency in milliseconds, whole: "85 ms" ("—" for None)."""
    return "—" if value is None else f"{value:,.0f} ms"

"""Small template filters for the dashboard."""

from django import template
from django.utils import timezone

register = template.Library()


@register.filter
def ago(when) -> str:
    """How long ago, short: "12 s", "4 min", "3 h 5 min", "2 d" (empty for None). Also takes a timedelta."""
    if when is None:
        return ""
    seconds = int(when.total_seconds() if hasattr(when, "total_seconds") else (timezone.now() - when).total_seconds())
    seconds = max(seconds, 0)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min"
    if seconds < 86400:
        hours, minutes = divmod(seconds // 60, 60)
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    return f"{seconds // 86400} d"

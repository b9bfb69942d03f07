"""Dashboard views. The full dashboard is its own issue; this is the login landing page."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from cluster.operations import cluster_status
from cluster.roles import role_of


@login_required
def home(request):
    return render(request, "home.html", {"status": cluster_status(), "role": role_of(request.user)})

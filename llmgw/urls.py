from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView

from agents.mirror_views import mirror_file
from cluster.api.views import NoSuchPathView
from dashboard.login import AdminLoginForm, LoginView

admin.site.login_form = AdminLoginForm  # the admin's login waits like the dashboard's



def bad_request(request, exception=None):
    """A 400 that reaches no view (a Host this server does not answer to): JSON for the API, a line for a page."""
    from django.core.exceptions import DisallowedHost
    from django.http import HttpResponseBadRequest, JsonResponse

    if isinstance(exception, DisallowedHost):
        host = request.META.get("HTTP_HOST", "")[:100]
        said = f"the Host header {host} is not one this server answers to"
    else:
        said = "bad request"
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": said}, status=400)
    return HttpResponseBadRequest(f"Bad request: {said} (LLMGW_ALLOWED_HOSTS, LLMGW_PUBLIC_URL).\n",
                                  content_type="text/plain")


handler400 = bad_request

urlpatterns = [
    path("login/", LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("api/v1/", include("llmgw.api_urls")),
    path("api/v1/schema/", SpectacularAPIView.as_view(), name="schema"),
    re_path(r"^api(/|$)", NoSuchPathView.as_view()),  # the API answers JSON everywhere under it, a 404 too
    path("mirror/<str:sha256>", mirror_file, name="mirror-file"),
    path("", include("dashboard.urls")),
]

from django.urls import path

from cluster.api import StatusView, router

urlpatterns = [path("status/", StatusView.as_view(), name="status"), *router.urls]

from django.urls import path, re_path

from gateway import views
from gateway.metrics_view import metrics_view

urlpatterns = [
    path("v1/chat/completions", views.chat_completions),
    path("v1/completions", views.completions),
    path("v1/embeddings", views.embeddings),
    path("v1/models", views.models_list),
    re_path(r"^v1/models/(?P<model>.+)$", views.model_detail),
    re_path(r"^v1(?:/(?P<rest>.*))?$", views.not_found),
    path("metrics", metrics_view),
]

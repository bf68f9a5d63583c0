"""The batch surfaces' paths (included at the root by nexus_site/urls.py)."""

from __future__ import annotations

from django.urls import path

from gateway.batches import views

urlpatterns = [
    path("v1/files", views.files, name="batch-files"),
    path("v1/files/<str:file_id>", views.file_detail, name="batch-file"),
    path(
        "v1/files/<str:file_id>/content", views.file_content, name="batch-file-content"
    ),
    path("v1/batches", views.batches, name="batches"),
    path("v1/batches/<str:batch_id>", views.batch_detail, name="batch"),
    path("v1/batches/<str:batch_id>/cancel", views.batch_cancel, name="batch-cancel"),
    path("v1/messages/batches", views.message_batches, name="message-batches"),
    path(
        "v1/messages/batches/<str:batch_id>",
        views.message_batch_detail,
        name="message-batch",
    ),
    path(
        "v1/messages/batches/<str:batch_id>/cancel",
        views.message_batch_cancel,
        name="message-batch-cancel",
    ),
    path(
        "v1/messages/batches/<str:batch_id>/results",
        views.message_batch_results,
        name="message-batch-results",
    ),
]

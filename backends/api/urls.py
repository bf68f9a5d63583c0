from __future__ import annotations

from rest_framework.routers import SimpleRouter

from backends.api.views import BackendModelViewSet, BackendViewSet, WorkerViewSet

router = SimpleRouter(trailing_slash=False)
router.register("backends", BackendViewSet, basename="backend")
router.register("backend-models", BackendModelViewSet, basename="backend-model")
router.register("workers", WorkerViewSet, basename="worker")

urlpatterns = router.urls

"""The endpoints of OpenAI's Files and Batches APIs and Anthropic's Message Batches.

Thin: each finds the caller's key, calls ``usage.batches`` and answers in the
SDK's shape; a ``BatchRequestError`` becomes the API's own error. A key sees
only its own files and batches (another key's id is a 404).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import wraps
from typing import Any

from django.db.models import Q, QuerySet
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from gateway.batches import shapes
from gateway.batches.clients import anthropic_error, json_body, openai_error, owner_of
from usage.batches import jobs, results, storage
from usage.batches.jobs import BatchRequestError, not_found
from usage.models import Batch, BatchApi, File, FilePurpose

View = Callable[..., HttpResponseBase]
MAX_PAGE = 100


def _surface(
    error_shape: Callable[[BatchRequestError], HttpResponseBase],
) -> Callable[[Callable[..., HttpResponseBase]], View]:
    """Wrap a view: CSRF-exempt, the caller's key as `owner`, errors shaped."""

    def wrap(view: Callable[..., HttpResponseBase]) -> View:
        @csrf_exempt
        @wraps(view)
        def wrapped(
            request: HttpRequest, *args: Any, **kwargs: Any
        ) -> HttpResponseBase:
            try:
                return view(request, owner_of(request), *args, **kwargs)
            except BatchRequestError as error:
                return error_shape(error)

        return wrapped

    return wrap


openai = _surface(openai_error)
anthropic = _surface(anthropic_error)


def _method_not_allowed(request: HttpRequest) -> BatchRequestError:
    return BatchRequestError(
        405,
        f"{request.method} is not allowed on {request.path}.",
        code="method_not_allowed",
    )


# OpenAI: files --------------------------------------------------------------


@openai
def files(request: HttpRequest, owner: str) -> HttpResponseBase:
    if request.method == "POST":
        return _upload(request, owner)
    if request.method != "GET":
        raise _method_not_allowed(request)
    found = File.objects.filter(owner_prefix=owner)
    purpose = request.GET.get("purpose")
    if purpose:
        found = found.filter(purpose=purpose)
    return _openai_page(request, found, shapes.openai_file)


def _upload(request: HttpRequest, owner: str) -> HttpResponseBase:
    purpose = request.POST.get("purpose")
    if purpose != FilePurpose.BATCH:
        raise BatchRequestError(
            400,
            f"purpose must be 'batch' (this gateway keeps batch files only), got "
            f"{purpose!r:.40}.",
            param="purpose",
            code="invalid_value",
        )
    upload = request.FILES.get("file")
    if upload is None:
        raise BatchRequestError(400, "file is required.", param="file")
    stored = jobs.store_input_file(owner, upload.name or "", upload.chunks())
    return JsonResponse(shapes.openai_file(stored))


@openai
def file_detail(request: HttpRequest, owner: str, file_id: str) -> HttpResponseBase:
    file = _own_file(owner, file_id)
    if request.method == "GET":
        return JsonResponse(shapes.openai_file(file))
    if request.method == "DELETE":
        jobs.delete_file(file)
        return JsonResponse({"id": file_id, "object": "file", "deleted": True})
    raise _method_not_allowed(request)


@openai
def file_content(request: HttpRequest, owner: str, file_id: str) -> HttpResponseBase:
    if request.method != "GET":
        raise _method_not_allowed(request)
    file = _own_file(owner, file_id)
    response = StreamingHttpResponse(
        storage.read_chunks(file.path), content_type="application/jsonl"
    )
    response["Content-Length"] = str(storage.size_of(file.path))
    return response


def _own_file(owner: str, file_id: str) -> File:
    file = File.objects.filter(id=file_id, owner_prefix=owner).first()
    if file is None:
        raise not_found("File", file_id)
    return file


# OpenAI: batches ------------------------------------------------------------


@openai
def batches(request: HttpRequest, owner: str) -> HttpResponseBase:
    if request.method == "GET":
        found = Batch.objects.filter(owner_prefix=owner, api=BatchApi.OPENAI)
        return _openai_page(request, found, shapes.openai_batch)
    if request.method != "POST":
        raise _method_not_allowed(request)
    body = json_body(request)
    if not isinstance(body, dict):
        raise BatchRequestError(400, "The body must be a JSON object.")
    batch = jobs.create_batch(
        owner,
        body.get("input_file_id"),
        body.get("endpoint"),
        body.get("completion_window"),
        body.get("metadata"),
    )
    return JsonResponse(shapes.openai_batch(batch))


@openai
def batch_detail(request: HttpRequest, owner: str, batch_id: str) -> HttpResponseBase:
    if request.method != "GET":
        raise _method_not_allowed(request)
    return JsonResponse(
        shapes.openai_batch(_own_batch(owner, batch_id, BatchApi.OPENAI))
    )


@openai
def batch_cancel(request: HttpRequest, owner: str, batch_id: str) -> HttpResponseBase:
    if request.method != "POST":
        raise _method_not_allowed(request)
    batch = jobs.cancel_batch(_own_batch(owner, batch_id, BatchApi.OPENAI))
    return JsonResponse(shapes.openai_batch(batch))


def _own_batch(owner: str, batch_id: str, api: str) -> Batch:
    batch = Batch.objects.filter(id=batch_id, owner_prefix=owner, api=api).first()
    if batch is None:
        raise not_found(
            "Batch" if api == BatchApi.OPENAI else "message batch", batch_id
        )
    return batch


def _openai_page(
    request: HttpRequest, found: QuerySet[Any], shape: Callable[[Any], dict[str, Any]]
) -> HttpResponseBase:
    limit = _limit(request.GET.get("limit"))
    after = request.GET.get("after")
    if after:
        found = _beyond(found, after, older=True)
    page = list(found.order_by("-created_at", "-id")[: limit + 1])
    data = [shape(item) for item in page[:limit]]
    return JsonResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(page) > limit,
        }
    )


def _beyond(found: QuerySet[Any], cursor_id: str, *, older: bool) -> QuerySet[Any]:
    """The objects older (or newer) than the one with id `cursor_id`, in the
    lists' order (created_at, then id); all of them for an unknown id."""
    cursor = found.filter(id=cursor_id).first()
    if cursor is None:
        return found
    side = "lt" if older else "gt"
    return found.filter(
        Q(**{f"created_at__{side}": cursor.created_at})
        | Q(created_at=cursor.created_at, **{f"id__{side}": cursor.id})
    )


def _limit(value: str | None, default: int = 20) -> int:
    if value is None:
        return default
    if not value.isdigit() or not 1 <= int(value) <= MAX_PAGE:
        raise BatchRequestError(
            400,
            f"limit must be from 1 to {MAX_PAGE}.",
            param="limit",
            code="invalid_value",
        )
    return int(value)


# Anthropic: message batches -------------------------------------------------


@anthropic
def message_batches(request: HttpRequest, owner: str) -> HttpResponseBase:
    if request.method == "GET":
        return _anthropic_page(request, owner)
    if request.method != "POST":
        raise _method_not_allowed(request)
    body = json_body(request)
    if not isinstance(body, dict):
        raise BatchRequestError(400, "The body must be a JSON object.")
    batch = jobs.create_message_batch(owner, body.get("requests"))
    return JsonResponse(shapes.anthropic_batch(batch, ""))


@anthropic
def message_batch_detail(
    request: HttpRequest, owner: str, batch_id: str
) -> HttpResponseBase:
    batch = _own_batch(owner, batch_id, BatchApi.ANTHROPIC)
    if request.method == "GET":
        return JsonResponse(_anthropic_shape(request, batch))
    if request.method == "DELETE":
        jobs.delete_batch(batch)
        return JsonResponse({"id": batch_id, "type": "message_batch_deleted"})
    raise _method_not_allowed(request)


@anthropic
def message_batch_cancel(
    request: HttpRequest, owner: str, batch_id: str
) -> HttpResponseBase:
    if request.method != "POST":
        raise _method_not_allowed(request)
    batch = jobs.cancel_batch(_own_batch(owner, batch_id, BatchApi.ANTHROPIC))
    return JsonResponse(_anthropic_shape(request, batch))


@anthropic
def message_batch_results(
    request: HttpRequest, owner: str, batch_id: str
) -> HttpResponseBase:
    if request.method != "GET":
        raise _method_not_allowed(request)
    batch = _own_batch(owner, batch_id, BatchApi.ANTHROPIC)
    if batch.is_active:
        raise BatchRequestError(
            404, f"The results of {batch_id} are not ready: it is still processing."
        )
    lines: Iterator[bytes] = results.anthropic_results(batch.id)
    return StreamingHttpResponse(lines, content_type="application/x-jsonl")


def _anthropic_shape(request: HttpRequest, batch: Batch) -> dict[str, Any]:
    url = request.build_absolute_uri(f"/v1/messages/batches/{batch.id}/results")
    return shapes.anthropic_batch(batch, url)


def _anthropic_page(request: HttpRequest, owner: str) -> HttpResponseBase:
    limit = _limit(request.GET.get("limit"))
    found: QuerySet[Any] = Batch.objects.filter(
        owner_prefix=owner, api=BatchApi.ANTHROPIC
    )
    before, after = request.GET.get("before_id"), request.GET.get("after_id")
    # Newest first; after_id pages to older ones, before_id to newer ones.
    newest_first = not before
    if after:
        found = _beyond(found, after, older=True)
    if before:
        found = _beyond(found, before, older=False)
    order = ("-created_at", "-id") if newest_first else ("created_at", "id")
    page = list(found.order_by(*order)[: limit + 1])
    shown = page[:limit]
    if not newest_first:
        shown.reverse()
    data = [_anthropic_shape(request, batch) for batch in shown]
    return JsonResponse(
        {
            "data": data,
            "has_more": len(page) > limit,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }
    )

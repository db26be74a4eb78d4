"""The adapters this server serves: GET /v1/adapters (what each is) and GET /v1/models (OpenAI's list: the base model
and one entry per adapter, as vLLM's servers name them)."""
from __future__ import annotations

from fastapi import APIRouter, Request

from .. import contract
from ..contract import error_docs
from .common import Api

BASE_MODELS = ("yue2", "YuE2-3B", "m-a-p/YuE2-3B")  # what `model` may say for the base model (the first is listed)


def adapter_listing(api: Api) -> dict:
    """`{name: info}` of the registered adapters (the service's rules hold them)."""
    return dict(getattr(api.service.rules, "adapters", None) or {})


def adapters_router(api: Api) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=api.auth)

    @router.get("/adapters", summary="The adapters songs may use (serve --lora-modules)",
                responses={200: {"model": contract.AdapterList}, **error_docs(*api.denied)})
    def adapters(request: Request):
        listing = adapter_listing(api)
        return api.answer(request, {"adapters": [listing[name] for name in sorted(listing)]})

    @router.get("/models", summary="OpenAI's model list: the base model, then each adapter (its parent the base)",
                responses={200: {"model": contract.ModelList}, **error_docs(*api.denied)})
    def models(request: Request):
        data = [{"id": BASE_MODELS[0], "object": "model", "owned_by": "yue2-vllm", "parent": None}]
        data += [{"id": name, "object": "model", "owned_by": "yue2-vllm", "parent": BASE_MODELS[0]}
                 for name in sorted(adapter_listing(api))]
        return api.answer(request, {"object": "list", "data": data})

    return router

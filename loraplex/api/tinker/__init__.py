"""The Tinker API (`/api/v1`): the official `tinker` SDK and `tinker-cookbook` train against loraplex unchanged.
Each route translates the SDK's wire (tinker-wire.md: JSON, and protobuf for forward_backward and its results) into a
call of the service layer (service/), the same call the native `/v1` route makes."""

from fastapi import APIRouter

from loraplex.api.tinker import rest, retrieve, sampling, session, training

router = APIRouter()
for _module in (session, training, sampling, retrieve, rest):
    router.include_router(_module.router)

__all__ = ["router"]

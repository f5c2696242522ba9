"""The service's web UI: pages for runs, a run's live plots, compare, launch and plan, served at
``/`` and ``/ui/...`` beside the API, for the same owners and tokens (:mod:`.routes`,
:mod:`.launch`; what the pages share: :mod:`.pages`, :mod:`.session`)."""

from fastapi import APIRouter

from .launch import router as forms_router
from .routes import router as runs_router

__all__ = ["router"]

router = APIRouter()
router.include_router(runs_router)
router.include_router(forms_router)

"""The service's web UI: pages for runs, a run's live plots, compare, launch and plan, served at
``/`` and ``/ui/...`` beside the API, for the same owners and tokens (:mod:`.routes`)."""

from .routes import router

__all__ = ["router"]

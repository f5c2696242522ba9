"""The service's routers: ``runs.router`` (ampkit's own API: ``/health``, ``/v1/...``) and
``finetuning.router`` (the brief's compatibility routes, ``/finetuning/...``, mapped onto ampkit's
runs). :func:`ampkit.service.app.create_app` includes both."""

"""An OpenAI-compatible sampling endpoint: `POST /v1/completions`, `POST /v1/chat/completions` (streaming too) and
`GET /v1/models`, so any OpenAI client can sample a tenant's sampler checkpoint, adapter or the base model.

    routes.py     the three routes: HTTP <-> the pieces below (the router app.py mounts)
    schemas.py    OpenAI's request bodies (unknown fields ignored; the ones that would change results refused)
    models.py     `model` -> a sampler (service.create_sampler, cached in Redis per tenant and model) and seq_ids
    tokenizer.py  the pool's tokenizer.json (`tokenizers`) and chat template (jinja2) on the gateway: no torch
    responses.py  samples -> OpenAI's completion / chat bodies, logprobs and stream chunks
    errors.py     OpenAI's error shape, used by api/errors.py for these paths

Nothing here is imported by this package's __init__, so api/errors.py can import errors.py without a cycle."""

"""HTTP only: the stateless FastAPI gateway. It owns what is HTTP: the app and its middleware (app.py), authentication
and the key checked before the body is read (deps.py, door.py), admission (body size, read time), the mapping of
loraplex.errors to status codes (errors.py), the gateway's Prometheus metrics, and the routes: native (routes/),
Tinker's (tinker/, protobuf and JSON) and OpenAI-compatible (openai/). Routes translate HTTP to calls of the
application layer (loraplex/service/), which holds the rules, writes through repositories and enqueues to Redis;
nothing here is imported by admin/, pipelines/ or the CLI (launch/gateway.py composes the app)."""

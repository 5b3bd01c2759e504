"""The gateway process's ASGI app, for uvicorn: `uvicorn loraplex.launch.gateway:app` (settings from LORAPLEX_* env vars).

The composition root of the gateway: the API (loraplex/api/app.py) with the web admin mounted at /admin
(loraplex/admin/, which sits above the API's service layer and so cannot be mounted from inside it)."""

from loraplex.admin.app import mount_admin
from loraplex.api.app import create_app
from loraplex.settings import get_settings

settings = get_settings()
app = create_app(settings)
mount_admin(app, settings, lambda: app.state.services)

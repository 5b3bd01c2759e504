"""Entry points: the `loraplex` CLI (cli.py, cli_pipelines.py, cli_pools.py), the embedded stack of `serve --embedded` and the demo
(embedded.py, demo.py), and the gateway's ASGI app for uvicorn (gateway.py). They compose processes; no rules live
here."""

"""``ragblend serve``: an OpenAI-compatible server that blends chunks found in any prompt.

``protocol`` (request/response bodies), ``jobs`` (requests → tokenised jobs), ``events`` (a
job, its events and handle), ``scheduler`` (per-step scheduling, batched decoding),
``metrics`` (Prometheus), ``app`` (the ASGI app: ``ragblend.serving.app.create_app``),
``command`` (the CLI). Needs ``pip install 'ragblend[serve]'``.
"""

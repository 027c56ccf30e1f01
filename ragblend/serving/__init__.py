"""``ragblend serve``: an OpenAI-compatible server that blends chunks found in any prompt.

``protocol`` (request/response bodies), ``jobs`` (requests → tokenised jobs), ``events`` (a
job, its events and handle), ``scheduler`` (per-step scheduling, batched decoding),
``running`` (one admitted request: sampling, text, logprobs), ``output`` (incremental text,
stop sequences), ``logprobs`` (OpenAI's logprobs shapes), ``state`` (loading, health),
``streaming`` (waiting, timeouts, server-sent events), ``middleware`` (request ids, API keys),
``metrics`` (Prometheus), ``app`` (the ASGI app: ``ragblend.serving.app.create_app``),
``command`` (the CLI). Needs ``pip install 'ragblend[serve]'``.
"""

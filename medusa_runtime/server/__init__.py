"""The runtime behind an OpenAI-compatible chat endpoint: continuous batching, streaming, a bounded queue.

    medusa-bench serve --model default --heads default --tree chain:2 --port 8000 --max-batch 16
    curl localhost:8000/v1/chat/completions -d '{"model": "default", "messages": [{"role": "user", "content": "Hi"}]}'

``protocol.py`` is the contract (requests, replies, chunks), ``app.py`` the ASGI app on the scheduler
(``medusa_runtime.decoding.scheduler``); ``bench.stages.serve`` runs it under uvicorn.
"""

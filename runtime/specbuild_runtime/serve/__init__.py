"""`specbuild serve`: an OpenAI-compatible HTTP server on the runtime (Starlette + uvicorn).

It lives in the runtime package, behind the `serve` extra (`pip install "specbuild-runtime[serve]"`), so
that a service installs the runtime and the server and nothing of the compiler's training stack: nothing
on this import path imports torch or transformers (tests/test_layout.py checks it). `specbuild serve` and
the runtime's own `specbuild-serve` script are the same command (cli.py; command.py is the script's entry point,
light to import, so that a Ctrl-C while the rest imports is one line).

Modules, in the order a request meets them: protocol.py (OpenAI request and response shapes), chat.py
(chat templates), app.py (routes), scheduler.py (queue, slots, worker threads), tools.py (tool calls read from a
reply, streamed or not), metrics.py (Prometheus).
"""

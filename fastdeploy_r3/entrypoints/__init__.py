"""The server room: the OpenAI-compatible and native (SGLang-style) HTTP APIs over one engine process.

    openai/       api_server.py (the app and `serve`), serving_* (completions, chat), protocol.py
    native/       /generate and the RL control endpoints (weights, pause, flush)
    pd/           prefill/decode disaggregation: the roles, P's bootstrap server, the handoff (docs/pd.md)
    engine_client.py   the API server's handle on the engine process; cli.py the `fastdeploy-r3` command

It is the top room: it may import any other; nothing imports it.
"""

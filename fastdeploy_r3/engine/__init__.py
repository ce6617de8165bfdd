"""The engine room: requests in, steps out. It owns the scheduler and the cache tiers, drives the
workers one step at a time, turns sampled tokens into outputs, and runs the RL control plane.

    engine_service.py   the loop: add / abort / step / shutdown      llm.py   offline LLM.generate
    engine_process.py, messages.py   the engine in its own process, and its ZMQ wire to the API server
    scheduler.py, request.py         continuous batching, chunked prefill, preemption
    token_processor.py, detokenizer.py, tokenizer.py   tokens -> text, stop checks, R3 row accounting
    worker_group.py, step_isolation.py, transfer_supervisor.py   the worker and CTM processes, supervised
    control.py                       pause / continue / flush, weight updates with version isolation

It may import every room below it (cache_manager/, worker/ messages, r3/, config/, blobstore/,
distributed/ through worker/); never entrypoints/.
"""

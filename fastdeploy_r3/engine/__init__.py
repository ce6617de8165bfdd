"""The engine room: requests in, steps out. It owns the scheduler and the cache tiers, drives the
workers one step at a time, turns sampled tokens into outputs, and runs the RL control plane.

    engine_service.py   the loop: add / abort / step / shutdown      llm.py   offline LLM.generate
    builder.py          starts the parts (workers, routing buffer, KV connectors, CTM) in one dataclass
    request_groups.py, step_builder.py   n>1 fan-out and deltas / what each step sends the workers
    engine_process.py, messages.py   the engine in its own process, and its ZMQ wire to the API server
    scheduler.py, request.py         continuous batching, chunked prefill, preemption
    token_processor.py, detokenizer.py, tokenizer.py   tokens -> text, stop checks, R3 row accounting
    worker_group.py, step_isolation.py   the worker processes, supervised; one request fails alone
    control.py, control_error.py, memory_control.py, weight_check.py   the RL control plane: pause
                        (abort / in_place / retract), flush, weight updates with version isolation,
                        release / resume memory, weight checksums

It may import every room below it (cache_manager/, worker/ messages, r3/, config/, blobstore/,
distributed/ through worker/); never entrypoints/.
"""

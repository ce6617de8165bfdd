"""The worker room: one process per tensor-parallel rank that holds the model and its KV cache and runs
the steps the engine sends.

    worker_process.py, messages.py   the process and every message between it and the engine
    model_runner.py, input_batch.py, cuda_graph_runner.py   one step: inputs, forward, decode graphs
    sample/          logits -> sampled ids and logprobs (penalties, draw, logprobs)
    routing_capture.py, routing_writer.py   R3 rows of a step, written to the shared routing buffer
    weight_updater.py                new weights in place (disk, a trainer's process group, IPC)

It may import model_executor/, cache_manager/ (shared memory, routing buffer), distributed/, config/
and r3/; never engine/.
"""
